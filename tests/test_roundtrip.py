"""Bit-exact round trips through ucl.save / ucl.open, and what native readers see."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import ucl
from ucl.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidNameError,
    StepExistsError,
    TensorNotFoundError,
)
from ucl.format.structure import flatten


def odd_state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(37, 11, generator=g),
        "f16": torch.randn(5, 3, 2, generator=g).half(),
        "bf16": torch.randn(129, generator=g).bfloat16(),
        "i64": torch.randint(-(2**62), 2**62, (13,), generator=g),
        "bool": torch.rand(7, 9, generator=g) > 0.5,
        "scalar": torch.tensor(-0.0),
        "empty": torch.empty(0, 4),
        "empty3": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(6, generator=g).to(torch.float8_e5m2),
        "specials": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38]),
        "noncontig": torch.randn(8, 6, generator=g).t(),
    }


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bits(a) == bits(b)


def test_odd_state_round_trips_bit_exactly(tmp_path) -> None:
    state = odd_state()
    ucl.save(state, tmp_path, step=7)
    with ucl.open(tmp_path) as ckpt:
        assert ckpt.step == 7
        assert ckpt.keys() == list(state)
        loaded = ckpt.load()
        for name, t in state.items():
            assert ckpt[name].shape == t.shape and ckpt[name].dtype == t.dtype
            assert_bit_exact(loaded[name], t)


def test_nested_state_with_optimizer_round_trips(tmp_path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1, "note": "hi"}
    ucl.save(state, tmp_path, step=1)
    loaded = ucl.load(tmp_path)
    assert loaded["step"] == 1 and loaded["note"] == "hi"
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert set(loaded["optim"]["state"]) == {0, 1}  # int keys come back as ints
    for k, v in state["model"].items():
        assert_bit_exact(loaded["model"][k], v)
    opt2 = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=0.5)
    opt2.load_state_dict(loaded["optim"])  # torch accepts what we return
    assert opt2.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize(
    "index",
    [np.s_[3:9], np.s_[:, 2], np.s_[5], np.s_[-1, -3:], np.s_[::4, 1:10:3], np.s_[...], np.s_[..., 0], np.s_[10:10]],
)
def test_slices_match_torch(tmp_path, index) -> None:
    t = torch.randn(37, 11)
    ucl.save({"t": t}, tmp_path, step=0)
    assert_bit_exact(ucl.open(tmp_path)["t"][index], t[index])


def test_partial_read_reads_only_needed_chunks(tmp_path, monkeypatch) -> None:
    from ucl.options import WriteOptions

    t = torch.randn(1024, 256)  # 1 MiB, 16 inner chunks of 64 rows (64 KiB)
    ucl.save({"t": t}, tmp_path, step=0, options=WriteOptions(inner_chunk_bytes=64 << 10))
    ckpt = ucl.open(tmp_path)
    part = ckpt["t"][128:256]
    assert_bit_exact(part, t[128:256])
    assert ckpt.bytes_read <= t.nbytes / 8 + 16 * 16 + 64  # 1/8 of the data, 2 chunks, plus the index


def test_zstd_round_trips(tmp_path) -> None:
    t = torch.zeros(1000, 100)
    t[::7] = 1.5
    ucl.save({"t": t}, tmp_path, step=0, compression="zstd")
    ckpt = ucl.open(tmp_path)
    assert ckpt.record.nbytes < t.nbytes / 4
    assert_bit_exact(ckpt["t"][:], t)
    assert ucl.validate(tmp_path).ok


def test_steps_and_latest(tmp_path) -> None:
    for s in (1, 5, 3):
        ucl.save({"s": torch.tensor(s)}, tmp_path, step=s)
    assert ucl.Repository.open(tmp_path).steps() == [1, 3, 5]
    assert ucl.open(tmp_path).step == 5
    assert int(ucl.open(tmp_path, 3)["s"][...]) == 3
    with pytest.raises(StepExistsError, match="step 3 is already committed"):
        ucl.save({"s": torch.tensor(0)}, tmp_path, step=3)
    with pytest.raises(CheckpointNotFoundError, match="step 4 does not exist"):
        ucl.open(tmp_path, 4)


def test_uncommitted_step_is_invisible_and_overwritable(tmp_path) -> None:
    ucl.save({"s": torch.tensor(1)}, tmp_path, step=1)
    ucl.save({"s": torch.tensor(2)}, tmp_path, step=2)
    (tmp_path / "commits" / "2.json").unlink()  # as if the writer died before committing
    assert ucl.open(tmp_path).step == 1
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        ucl.open(tmp_path, 2)
    ucl.save({"s": torch.tensor(22)}, tmp_path, step=2)
    assert int(ucl.open(tmp_path)["s"][...]) == 22


def test_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no ucl repository"):
        ucl.open(tmp_path / "nothing")
    with pytest.raises(InvalidArgumentError, match="state dict value at 'x/0' is a object; ucl stores tensors"):
        ucl.save({"x": [object()]}, tmp_path, step=0)
    ucl.save({"t": torch.ones(3)}, tmp_path, step=0)
    with pytest.raises(TensorNotFoundError, match="step 0 has no tensor 'u'"):
        ucl.open(tmp_path)["u"]
    with pytest.raises(InvalidArgumentError, match="out of bounds"):
        ucl.open(tmp_path)["t"][5]


def test_memory_url_round_trip() -> None:
    state = odd_state()
    ucl.save(state, "memory://ucl-test/repo", step=3)
    loaded = ucl.load("memory://ucl-test/repo", flat=True)
    for name, t in state.items():
        assert_bit_exact(loaded[name], t)
    assert ucl.validate("memory://ucl-test/repo").ok


def test_file_url(tmp_path) -> None:
    ucl.save({"t": torch.arange(5)}, f"file://{tmp_path}", step=1)
    assert torch.equal(ucl.open(tmp_path)["t"][:], torch.arange(5))


def test_tensorstore_reads_without_ucl(tmp_path) -> None:
    state = odd_state()
    ucl.save(state, tmp_path, step=4)
    script = r"""
import sys, hashlib, json, tensorstore as ts
out = {}
for name in json.loads(sys.argv[2]):
    a = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{sys.argv[1]}/steps/4/{name}"}}).result()
    x = a.read().result()
    out[name] = [str(x.dtype), list(x.shape), hashlib.sha256(x.tobytes()).hexdigest()]
assert "ucl" not in sys.modules
print(json.dumps(out))
"""
    import hashlib
    import json

    names = [n for n in state if n != "noncontig"]
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), json.dumps(names)], capture_output=True, text=True,
                       check=True)
    got = json.loads(r.stdout)
    for n in names:
        t = state[n]
        assert got[n][1] == list(t.shape)
        assert got[n][2] == hashlib.sha256(bits(t)).hexdigest(), n


def test_zarr_python_reads_after_import_ucl(tmp_path) -> None:
    import zarr

    state = odd_state()
    ucl.save(state, tmp_path, step=4)
    g = zarr.open_group(str(tmp_path / "steps" / "4"), mode="r")
    for name, t in state.items():
        x = np.asarray(g[name][...])
        assert list(x.shape) == list(t.shape)
        assert x.tobytes() == bits(t), name


def test_flatten_refuses_pickles_and_bad_keys() -> None:
    with pytest.raises(InvalidArgumentError, match="never pickles"):
        flatten({"a": object()})
    assert list(flatten({"a/b": torch.ones(1)})[0]) == ["a/b"]  # flat keys with '/' are names as they are
    with pytest.raises(InvalidNameError, match="two tensors of the state dict flatten to the name 'a/b'"):
        flatten({"a/b": torch.ones(1), "a": {"b": torch.ones(1)}})
