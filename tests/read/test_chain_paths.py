"""The fast paths of reading delta steps (ucl.read.chain, ucl._delta unpack/apply): bit-exact against what
was saved and against the plain algorithm (``ChainReader.read_sequential``), with the same errors.

Each test runs with the reader's thresholds as shipped and with every path forced (one inner chunk per
group, every group on the pools, every chunk decoded as parallel tasks split into word ranges).
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import ucl
import ucl.delta.chain as chain_mod
import ucl.format.shardfile
from ucl import _delta
from ucl.delta import bit_view, decode_chunk, encode_chunk
from ucl.errors import DeltaChainError, UCLError
from ucl.options import DEFAULT_READ, ChainOptions, ReadOptions, WriteOptions
from ucl.read.chain import ChainReader
from ucl.read.chunks import Request
from ucl.read.files import StepFiles
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return (t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy().tobytes()


# wide: every group in flight at once (errors met in any order); narrow: one group at a time
_FORCED = ChainOptions(small_bytes=0, parallel_min_bytes=0, group_bytes=1, inflight_bytes=1 << 40, decode_threads=3)
OPTIONS = {"shipped": ReadOptions(), "forced": ReadOptions(chain=_FORCED),
           "forced-narrow": ReadOptions(chain=replace(_FORCED, inflight_bytes=1))}


@pytest.fixture(params=["shipped", "forced", "forced-narrow"])
def paths(request, monkeypatch):
    if request.param.startswith("forced"):
        monkeypatch.setattr(chain_mod, "APPLY_MIN_WORDS", 1)
    return request.param


def _state(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(96, 40, generator=g),  # several inner chunks, edge chunks padded
        "bf": torch.randn(70, 9, generator=g).bfloat16(),
        "cplx": torch.randn(33, 3, dtype=torch.complex128, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (50,), generator=g),
        "flag": torch.rand(37, generator=g) > 0.5,
        "scalar": torch.tensor(1.5),
        "frozen": torch.randn(20, 20, generator=g),
        "exp_avg_sq": torch.rand(64, 16, generator=g),
    }


def _step(state: dict[str, torch.Tensor], k: int, g: torch.Generator) -> None:
    state["w"].add_(1e-3 * torch.randn(state["w"].shape, generator=g))
    state["w"][k % 96, : k + 1] = float("nan") if k % 2 else -0.0
    state["bf"] += 0.125
    state["cplx"][k % 33] *= 1j
    state["i64"] += k
    state["flag"] = ~state["flag"] if k % 2 else state["flag"]
    state["scalar"] += 1
    state["exp_avg_sq"].mul_(0.99).add_(1e-4)


def _write(root: Path, base: str, steps: int, inner: int = 1024) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    state = _state(g)
    saved = {}
    # many inner chunks per shard
    with CheckpointManager(root, delta=DeltaPolicy(base=base), options=WriteOptions(inner_chunk_bytes=inner)) as mgr:
        for k in range(steps):
            saved[k] = {n: t.clone() for n, t in state.items()}
            mgr.save(k, state)
            _step(state, k, g)
        mgr.wait()
    return saved


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict[str, tuple[Path, dict[int, dict[str, torch.Tensor]]]]:
    out = {}
    for base in ("previous", "full"):
        root = tmp_path_factory.mktemp(base) / "repo"
        out[base] = (root, _write(root, base, 6))
    return out


def _reader(path: str | Path, step: int, options: ReadOptions = DEFAULT_READ) -> ChainReader:
    repo = ucl.Repository.open(path)
    cache: dict[int, tuple[object, StepFiles]] = {}

    def get(s: int):  # type: ignore[no-untyped-def]
        if s not in cache:
            rec = repo.commit_record(s)
            cache[s] = (repo.step_meta(s, rec), StepFiles(repo.store, s, rec))
        return cache[s]

    return ChainReader(step, get, options=options)  # type: ignore[arg-type]


def _request(r: ChainReader, name: str, box: tuple[slice, ...] | None = None) -> Request:
    meta = r.get(r.step)[0].arrays[name]
    if box is None:
        start, shape = (0,) * len(meta.shape), meta.shape
    else:
        start = tuple(s.start for s in box)
        shape = tuple(s.stop - s.start for s in box)
    out = torch.full(shape, 7, dtype=ucl.format.dtypes.to_torch(meta.dtype))
    return Request(meta, start, shape, out)


BOXES = {
    "w": [(slice(3, 50), slice(1, 39)), (slice(0, 96), slice(0, 40)), (slice(95, 96), slice(39, 40)),
          (slice(10, 10), slice(0, 5)), (slice(40, 41), slice(0, 40))],
    "bf": [(slice(1, 69), slice(2, 9))],
    "cplx": [(slice(5, 33), slice(0, 2))],
    "i64": [(slice(7, 49),)],
    "flag": [(slice(3, 36),)],
    "scalar": [()],
}


@pytest.mark.parametrize("base", ["previous", "full"])
def test_every_step_bit_exact_whole_and_sliced(chains, paths, base) -> None:
    root, saved = chains[base]
    for step, want in saved.items():
        got = ucl.load(root, step, flat=True, options=OPTIONS[paths])  # through Checkpoint: ChainReader.read per tensor
        assert got.keys() == want.keys()
        for n in want:
            assert got[n].dtype == want[n].dtype and bits(got[n]) == bits(want[n]), (step, n)
        if step == 0:
            continue
        r = _reader(root, step, OPTIONS[paths])
        reqs = [_request(r, n) for n in want]
        r.read_many(reqs)  # every tensor in one pipeline
        for q in reqs:
            assert bits(q.out) == bits(want[q.meta.name]), (step, q.meta.name)
        for n, boxes in BOXES.items():
            for box in boxes:
                fast, slow = _request(r, n, box), _request(r, n, box)
                r.read(fast)
                r.read_sequential(slow)
                assert bits(fast.out) == bits(slow.out) == bits(want[n][box]), (step, n, box)


def test_reads_after_the_page_cache_is_dropped_and_buffered_only(chains, paths, monkeypatch) -> None:
    root, saved = chains["previous"]
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    # every read O_DIRECT (where the kernel allows it), then every read buffered
    got = ucl.load(root, 5, flat=True, options=replace(OPTIONS[paths], direct_min_bytes=1))
    assert all(bits(got[n]) == bits(t) for n, t in saved[5].items())
    got = ucl.load(root, 4, flat=True, options=replace(OPTIONS[paths], direct=False))
    assert all(bits(got[n]) == bits(t) for n, t in saved[4].items())


def test_a_memory_store_reads_the_same(paths) -> None:
    g = torch.Generator().manual_seed(3)
    state = _state(g)
    saved = {}
    url = f"memory://perf-paths-{paths}-{os.getpid()}-{id(saved)}"
    with CheckpointManager(url, delta=True) as mgr:
        for k in range(4):
            saved[k] = {n: t.clone() for n, t in state.items()}
            mgr.save(k, state)
            _step(state, k, g)
        mgr.wait()
    for k, want in saved.items():
        got = ucl.load(url, k, flat=True, options=OPTIONS[paths])
        assert all(bits(got[n]) == bits(t) for n, t in want.items())


def test_concurrent_reads_on_one_reader(chains, paths) -> None:
    root, saved = chains["previous"]
    r = _reader(root, 5, OPTIONS[paths])
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                reqs = [_request(r, n) for n in saved[5]]
                r.read_many(reqs[i % 3 :] + reqs[: i % 3])
                for q in reqs:
                    assert bits(q.out) == bits(saved[5][q.meta.name])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# -- errors: the same as the plain algorithm's, whatever the path ----------------------------------
def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


def _shard(root: Path, step: int, name: str) -> Path:
    meta = ucl.Repository.open(root).step_meta(step).arrays[name]
    return root / "steps" / str(step) / meta.shard_key((0,) * len(meta.shape))


def _raised(fn) -> BaseException:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("no error")


def _same_error(root: Path, step: int, names: list[str], options: ReadOptions = DEFAULT_READ) -> BaseException:
    """Read ``names`` of ``step`` three ways: each must raise, with the same error type, code and message."""
    r = _reader(root, step, options)
    seq = _raised(lambda: [r.read_sequential(_request(r, n)) for n in names])
    many = _raised(lambda: _reader(root, step, options).read_many([_request(r, n) for n in names]))
    one = _raised(lambda: [_reader(root, step, options).read(_request(r, n)) for n in names])
    for e in (many, one):
        assert type(e) is type(seq) and str(e) == str(seq), (e, seq)
        if isinstance(seq, UCLError):
            assert isinstance(e, UCLError) and (e.code, e.tensor, e.file) == (seq.code, seq.tensor, seq.file)
    return seq


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "index"])
def test_damage_in_a_middle_link_raises_the_same_error(chains, paths, tmp_path, damage) -> None:
    root = _copy(chains["previous"][0], tmp_path / "repo")
    f = _shard(root, 2, "w")  # step 2 of the chain 0 <- 1 <- ... <- 5
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 3] ^= 0x10  # inside a payload
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        f.unlink()
    else:
        data[-10] ^= 0x01  # the index
        f.write_bytes(bytes(data))
    e = _same_error(root, 5, ["frozen", "w", "bf"], OPTIONS[paths])
    assert isinstance(e, DeltaChainError) and "step 2" in str(e) and "(a base of step 5)" in str(e), e
    with pytest.raises(DeltaChainError) as info:
        ucl.load(root, 5, options=OPTIONS[paths])
    assert str(info.value) == str(e)
    # the step itself reports its own error, not a broken chain
    own = _same_error(root, 2, ["w"], OPTIONS[paths])
    assert not isinstance(own, DeltaChainError) and own.code in (  # type: ignore[attr-defined]
        "checksum_mismatch", "size_mismatch", "missing_shard", "corrupt_shard_index")


def test_a_malformed_payload_with_a_valid_crc_is_an_integrity_error_naming_its_step(chains, paths,
                                                                                tmp_path) -> None:
    from ucl.io import native as _native

    root = _copy(chains["previous"][0], tmp_path / "repo")
    for step in (2, 4):  # the oldest is reported: decoding goes oldest first
        f = _shard(root, step, "w")
        data = bytearray(f.read_bytes())
        meta = ucl.open(root, step, options=OPTIONS[paths]).meta.arrays["w"]
        n = meta.n_inner
        index = np.frombuffer(bytes(data[-(16 * n + 4) : -4]), "<u8").reshape(n, 2)
        off, nb = next((int(o), int(b)) for o, b in index if o != 2**64 - 1)
        data[off + 1 : off + 5] = b"\x00\x00\x00\x00"  # the first frame's magic: not a zstd frame
        data[off + nb - 4 : off + nb] = _native.crc32c(bytes(data[off : off + nb - 4])).to_bytes(4, "little")
        f.write_bytes(bytes(data))
    e = _same_error(root, 5, ["w"], OPTIONS[paths])
    assert isinstance(e, DeltaChainError) and "of step 2 (a base of step 5): [integrity_error]" in str(e), e


def test_errors_come_in_request_order(chains, paths, tmp_path) -> None:
    root = _copy(chains["previous"][0], tmp_path / "repo")
    names = ["w", "bf", "cplx", "i64", "exp_avg_sq"]
    for name in names:  # every chunk of every link of these damaged: errors everywhere, the first wins
        for step in (1, 2, 3):
            f = _shard(root, step, name)
            if not f.exists():  # unchanged in that step
                continue
            data = bytearray(f.read_bytes())
            n_inner = ucl.Repository.open(root).step_meta(step).arrays[name].n_inner
            for i in range(0, len(data) - 16 * n_inner - 4, 97):  # the payloads, not the index
                data[i] ^= 0x01
            f.write_bytes(bytes(data))
    for order in (names, names[::-1], names[2:] + names[:2]):
        for _ in range(3):
            e = _same_error(root, 4, order, OPTIONS[paths])
            assert f"tensor {order[0]!r}" in str(e), (order, e)


def test_a_newer_full_payload_makes_an_older_corrupt_link_harmless(paths, tmp_path) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 64, generator=g)
    with CheckpointManager(tmp_path, delta=True) as mgr:
        mgr.save(0, {"w": w})
        mgr.save(1, {"w": w + 1e-3})
        fresh = torch.randn(256, 64, generator=g) * 1e3  # unrelated values: stored full (mode 0) in step 2
        mgr.save(2, {"w": fresh})
        mgr.wait()
    f = _shard(tmp_path, 2, "w")
    data = f.read_bytes()
    assert data[0] == 0, "step 2's payload should hold full values"
    g1 = _shard(tmp_path, 1, "w")
    bad = bytearray(g1.read_bytes())
    bad[100] ^= 0xFF
    g1.write_bytes(bytes(bad))
    assert torch.equal(ucl.load(tmp_path, 2, options=OPTIONS[paths])["w"], fresh)
    r = _reader(tmp_path, 2, OPTIONS[paths])
    q = _request(r, "w")
    r.read_many([q])
    assert bits(q.out) == bits(fresh)
    # the older links are not even read: the same bytes as the plain algorithm
    seq = _reader(tmp_path, 2, OPTIONS[paths])
    seq.read_sequential(_request(seq, "w"))

    def read_bytes(x: ChainReader) -> int:
        return sum(x.get(s)[1].bytes_read for s in (0, 1, 2))

    assert read_bytes(r) == read_bytes(seq) and read_bytes(r) < 2 * data.__len__()
    with pytest.raises(ucl.errors.ChecksumError, match="crc32c"):  # step 1 itself is damaged
        ucl.load(tmp_path, 1, options=OPTIONS[paths])


# -- the C halves of decode ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_unpack_and_apply_equal_decode(dtype) -> None:
    rng = np.random.default_rng(int(np.dtype(dtype).itemsize))
    word = np.dtype(dtype).itemsize
    for n in (1, 15, 16, 17, 8191, 8193, 40000):
        seq = [rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)]
        for k in range(5):
            nxt = seq[-1].copy()
            idx = rng.integers(0, n, max(1, n // 4))
            nxt[idx] += dtype(k + 1)
            seq.append(nxt)
        payloads = [encode_chunk(bit_view(b), bit_view(a), "xor" if k % 2 else "sub")
                    for k, (a, b) in enumerate(zip(seq, seq[1:], strict=False))]
        payloads[2] = encode_chunk(bit_view(seq[3]), None, "xor")  # a full payload in the middle
        ref = seq[0].copy()
        for p in payloads:
            decode_chunk(p, ref, ref)
        assert np.array_equal(ref, seq[-1])
        for nparts in (1, 2, 3):
            planes, modes = [], []
            for p in payloads:
                buf = np.full(seq[0].nbytes, 0xAB, np.uint8)
                res = [_delta.unpack(p, buf, word, i, nparts) for i in range(nparts)]
                assert all(r[0] == 0 and r[2] == 0 for r in res)
                planes.append(buf)
                modes.append(res[0][1])
            out = np.zeros_like(seq[0])
            cut = n // 3
            assert _delta.apply(planes, modes, seq[0], out, word, 0, cut) == 0
            assert _delta.apply(planes, modes, seq[0], out, word, cut, n - cut) == 0
            assert np.array_equal(out, seq[-1])
            later = seq[0].copy()  # in place, from the full payload on: no base needed
            assert _delta.apply(planes[2:], modes[2:], None, later, word, 0, n) == 0
            assert np.array_equal(later, seq[-1])


def test_unpack_reports_what_decode_reports_on_damaged_payloads() -> None:
    rng = np.random.default_rng(9)
    a = rng.standard_normal(20000).astype(np.float32)
    b = a + np.float32(1e-3) * rng.standard_normal(a.size).astype(np.float32)
    good = encode_chunk(bit_view(b), bit_view(a), "xor")
    assert good is not None
    cases = [b"", b"\x07", b"\x01", b"\x01\x28\xb5\x2f\xfd", good[:-1], good + b"\x00",
             good[: len(good) // 2]]
    for _ in range(200):
        bad = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            bad[int(rng.integers(0, len(bad)))] ^= int(rng.integers(1, 256))
        cases.append(bytes(bad))
    for p in cases:
        want, _ = _delta.decode(p, bit_view(a).copy(), bit_view(a).copy(), 4)
        for nparts in (1, 2, 4):
            buf = np.empty(a.nbytes, np.uint8)
            res = [_delta.unpack(p, buf, 4, i, nparts) for i in range(nparts)]
            got = -7 if any(r[2] for r in res) else res[0][0]
            assert got == want, (p[:16], nparts, res, want)
    z4, z8 = np.zeros(4, np.uint8), np.zeros(8, np.uint8)
    assert _delta.apply([z8], [1], None, z8.copy(), 4, 0, 2) == -5  # a delta needs a base
    assert _delta.apply([z8], [0], None, z8.copy(), 4, 0, 3) == -1  # out of range
    assert _delta.apply([z4], [0], None, z8.copy(), 4, 0, 1) == -1  # sizes differ
    assert _delta.apply([z8], [3], None, z8.copy(), 4, 0, 1) == -1  # not a mode
