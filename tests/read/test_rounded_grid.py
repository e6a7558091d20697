"""Arrays whose grid chunk passes the array's end (spec/core.md §6: a writer holding a dimension whole
rounds its chunk up to a multiple of the inner chunk) and whose inner chunks split two dimensions (a
writer's block with no divisor near the target): every reader path, bit for bit. ucl's plain reads
(whole, slices, boxes), tensorstore and zarr-python reading the step's files directly, the zarr_store
adapter, layouts (save_sharded with uneven splits, resharded loads), delta chains on such bases (and a
compacted base), the validator."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ucl
from ucl.format.shardfile import choose_chunks
from ucl.layout import Mesh, parse_layout
from ucl.options import WriteOptions
from ucl.testing.layout_reference import shard_local_state
from ucl.tools.compact import compact
from ucl.write.manager import CheckpointManager

SMALL = WriteOptions(inner_chunk_bytes=4096)  # 1-8 KiB inner chunks: small tensors take every path


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return (t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy().tobytes()


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct bit patterns of ``dtype`` (2 or 4 bytes), none a NaN that could hide a misplaced element."""
    g = torch.Generator().manual_seed(seed)
    word = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    n = math.prod(shape)
    words = torch.randint(0, 1 << (8 * dtype.itemsize - 2), (n,), generator=g, dtype=word)
    return words.view(dtype).reshape(shape)


def native_bytes(path: Path, step: int, name: str) -> tuple[bytes, bytes]:
    """The array read by tensorstore and by zarr-python from the step's files (no ucl involved)."""
    import tensorstore as ts
    import zarr

    from ucl.format.dtypes import register_zarr_dtypes

    register_zarr_dtypes()  # bfloat16 for zarr-python (what `import ucl` arranges by entry point)
    where = str(path / "steps" / str(step) / name)
    a = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": where}}).result().read().result()
    z = np.asarray(zarr.open_array(where, mode="r")[...])
    return np.ascontiguousarray(a).tobytes(), np.ascontiguousarray(z).tobytes()


def check_reads(path: Path, step: int, state: dict[str, torch.Tensor], native: bool = True,
                boxes: int = 12) -> None:
    rnd = random.Random(step)
    with ucl.open(path, step) as ck:
        for name, t in state.items():
            assert bits(ck[name][...]) == bits(t), name
            assert bits(ck[name][-1:]) == bits(t[-1:]), name  # the padded edge chunk
            for _ in range(boxes):
                idx = []
                for n in t.shape:
                    a = rnd.randrange(n)
                    idx.append(slice(a, rnd.randrange(a + 1, n + 1)))
                assert bits(ck[name][tuple(idx)]) == bits(t[tuple(idx)]), (name, idx)
    got = ucl.load(path, step, flat=True)
    assert all(bits(got[n]) == bits(t) for n, t in state.items())
    if native:
        for name, t in state.items():
            ts_bytes, zarr_bytes = native_bytes(path, step, name)
            assert ts_bytes == bits(t), name
            assert zarr_bytes == bits(t), name


# shapes whose dimensions have no divisor near 1-8 KiB / 4 KiB: primes, vocab-like, 1-d
SHAPES = [(1009, 7), (3, 211, 13), (50257,), (257, 101), (5, 7, 11, 13), (8191,), (1, 4099)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounded_grids_read_back_everywhere(tmp_path: Path, dtype: torch.dtype) -> None:
    state = {f"t{i}": values(s, dtype, i) for i, s in enumerate(SHAPES)}
    ucl.save(state, tmp_path, step=0, options=SMALL)
    meta = ucl.open(tmp_path).meta
    rounded = [n for n, a in meta.arrays.items() if a.chunk_shape != a.shape]
    assert len(rounded) >= 3, {n: (a.chunk_shape, a.inner_chunk_shape) for n, a in meta.arrays.items()}
    for a in meta.arrays.values():
        if a.nbytes >= 1024:
            assert 1024 <= a.inner_nbytes <= 8192, (a.shape, a.inner_chunk_shape)
    check_reads(tmp_path, 0, state)
    assert ucl.validate(tmp_path).ok


def test_real_vocabularies(tmp_path: Path) -> None:
    """The shapes of issue 14 at the default 4 MiB target: LLaMA's [32001, 4096] (bf16), GPT-2's
    [50257, 768] and a [50257] vector."""
    state = {"emb": values((32001, 4096), torch.bfloat16, 1), "wte": values((50257, 768), torch.float32, 2),
             "bias": values((50257,), torch.float32, 3)}
    ucl.save(state, tmp_path, step=0)
    arrays = ucl.open(tmp_path).meta.arrays
    assert (arrays["emb"].chunk_shape, arrays["emb"].inner_chunk_shape) == ((32004, 4096), (508, 4096))
    assert (arrays["wte"].chunk_shape, arrays["wte"].inner_chunk_shape) == ((50280, 768), (1676, 768))
    assert arrays["bias"].inner_chunk_shape == (50257,)
    check_reads(tmp_path, 0, state, boxes=4)
    assert ucl.validate(tmp_path).ok


def test_zarr_store_adapter(tmp_path: Path) -> None:
    import zarr

    state = {"a": values((1009, 7), torch.float32, 5), "b": values((257, 101), torch.bfloat16, 6)}
    ucl.save(state, tmp_path, step=0, options=SMALL)
    g = zarr.open_group(store=ucl.zarr_store(tmp_path), mode="r")
    for name, t in state.items():
        assert np.ascontiguousarray(g[name][...]).tobytes() == bits(t)
        assert np.ascontiguousarray(g[name][3:11]).tobytes() == bits(t[3:11])


LAYOUTS = [
    # rows among 3 writers (blocks of ceil(1009/3) = 337 rows, a prime; 211 columns held whole)
    ('"w": shard(0, tp)', Mesh.of(tp=3), {"w": (1009, 211)}),
    # columns among 2 (blocks of 51 columns); the rows held whole, rounded
    ('"w": shard(1, tp)', Mesh.of(tp=2), {"w": (1009, 101)}),
    # an uneven nested split (a blocked array) and a replicated vocab-like tensor
    ('"w": shard(0, dp), shard(0, tp)\n"e": replicate', Mesh.of(dp=2, tp=2),
     {"w": (1013, 37), "e": (4099, 3)}),
]


@pytest.mark.parametrize(("rules", "mesh", "shapes"), LAYOUTS, ids=["rows3", "cols2", "nested"])
def test_layout_saves_with_uneven_splits(tmp_path: Path, rules: str, mesh: Mesh, shapes: dict) -> None:
    layout = parse_layout("ucl-layout 1\n" + rules + "\n")
    full = {n: values(s, torch.float32, i) for i, (n, s) in enumerate(shapes.items())}
    locs = [shard_local_state(full, layout, mesh, r) for r in range(mesh.size)]
    ucl.save_sharded(locs, tmp_path, 0, layout=layout, mesh=mesh, options=SMALL)
    arrays = ucl.open(tmp_path).meta.arrays
    for a in arrays.values():
        block = math.prod(min(c, s) for c, s in zip(a.chunk_shape, a.shape, strict=True)) * a.itemsize
        if block >= 8192:
            assert 1024 <= a.inner_nbytes <= 8192, (a.name, a.shape, a.chunk_shape, a.inner_chunk_shape)
    assert any(a.chunk_shape[d] > a.shape[d] for a in arrays.values() for d in range(len(a.shape)))
    got = ucl.load(tmp_path, flat=True)
    assert all(bits(got[n]) == bits(t) for n, t in full.items())
    with ucl.open(tmp_path) as ck:
        for n, t in full.items():
            assert bits(ck[n][5:13]) == bits(t[5:13])
    for r in range(mesh.size):  # each rank its own block back
        back = ucl.load(tmp_path, layout=layout, mesh=mesh, rank=r, flat=True)
        assert all(bits(back[n]) == bits(locs[r][n]) for n in back)
    other = parse_layout('ucl-layout 1\n"*": shard(1, tp)\n')  # resharded: columns among 3
    for r in range(3):
        want = shard_local_state(full, other, Mesh.of(tp=3), r)
        back = ucl.load(tmp_path, layout=other, mesh=Mesh.of(tp=3), rank=r, flat=True)
        assert all(bits(back[n]) == bits(want[n]) for n in want)
    plain = [n for n, a in arrays.items() if not a.logical]  # stored as the logical tensor: native zarr
    for n in plain:
        assert native_bytes(tmp_path, 0, n) == (bits(full[n]), bits(full[n]))
    assert ucl.validate(tmp_path).ok


def test_delta_chains_on_rounded_bases(tmp_path: Path) -> None:
    """Delta steps use their base's grid; chains, slices and a compacted link read back bit for bit."""
    state = {"w": values((1009, 7), torch.float32, 7), "v": values((8191,), torch.bfloat16, 8),
             "m": values((257, 101), torch.float32, 9)}
    steps = []
    with CheckpointManager(tmp_path, delta=True, options=SMALL) as mgr:
        for step in range(4):
            steps.append({k: v.clone() for k, v in state.items()})
            mgr.save(step, state).result()
            state["w"][step * 300 % 1009] += 1.0  # one inner chunk changes, the padded last one included
            state["w"][-1] += 2.0
            state["v"][-3:] = state["v"][-3:] + 1
            state["m"][:, -1] += 0.5  # a column: every row-chunk of m changes
    repo = ucl.Repository.open(tmp_path)
    assert [repo.commit_record(s).kind for s in range(4)] == ["full", "delta", "delta", "delta"]
    meta = ucl.open(tmp_path, 0).meta
    assert any(a.chunk_shape != a.shape for a in meta.arrays.values())
    for step, s in enumerate(steps):
        check_reads(tmp_path, step, s, native=step == 0)
    assert ucl.validate(tmp_path).ok
    compact(tmp_path, 2)  # a link of the chains of step 3, rewritten full: same grid, same inner chunks
    assert ucl.open(tmp_path, 2).meta.arrays["w"].inner_chunk_shape == meta.arrays["w"].inner_chunk_shape
    for step in (2, 3):
        check_reads(tmp_path, step, steps[step], native=step == 2)
    assert ucl.validate(tmp_path).ok


def test_grid_of_the_rounded_arrays(tmp_path: Path) -> None:
    """What is on disk: the zarr.json of a rounded array, and no inner chunk wholly outside it."""
    import json

    ucl.save({"w": values((1009, 7), torch.float32, 1)}, tmp_path, step=0, options=SMALL)
    doc: Any = json.loads((tmp_path / "steps" / "0" / "w" / "zarr.json").read_text())
    chunk = doc["chunk_grid"]["configuration"]["chunk_shape"]
    inner = doc["codecs"][0]["configuration"]["chunk_shape"]
    assert (tuple(chunk), tuple(inner)) == choose_chunks((1009, 7), (1009, 7), 4, 4096)
    assert chunk[0] > 1009 and chunk[0] - 1009 < inner[0] and chunk[0] % inner[0] == 0
