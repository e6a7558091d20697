"""Lazy tensors as numpy and torch see them: ``np.asarray(t)`` (``__array__``), ``torch.as_tensor(t)``
(``__dlpack__``), and indexing that agrees with numpy's, IndexError included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
from ucl.errors import InvalidArgumentError
from ucl.read.tensors import IndexOutOfRangeError

SHAPES = [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("arrays") / "c"
    state = {f"t{i}": torch.arange(max(1, int(np.prod(s))), dtype=torch.float32)[: int(np.prod(s))].reshape(s)
             for i, s in enumerate(SHAPES)}
    state["bf"] = torch.arange(6, dtype=torch.float32).reshape(2, 3).bfloat16()
    state["i8"] = torch.arange(-3, 3, dtype=torch.int8)
    ucl.save(state, path, step=0)
    with ucl.open(path) as c:
        yield c


def _index_item(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from(["int", "slice", "slice", "none", "ellipsis"]))
    if kind == "int":
        return draw(st.integers(-6, 6))
    if kind == "none":
        return None
    if kind == "ellipsis":
        return Ellipsis
    bound = st.one_of(st.none(), st.integers(-7, 7))
    step = st.one_of(st.none(), st.integers(-3, 3).filter(lambda s: s != 0))
    return slice(draw(bound), draw(bound), draw(step))


@st.composite
def indexes(draw: st.DrawFn) -> object:
    items = tuple(_index_item(draw) for _ in range(draw(st.integers(0, 5))))
    if len(items) == 1 and draw(st.booleans()):
        return items[0]  # a bare index, not a tuple
    return items


def _numpy_outcome(x: np.ndarray, key: object) -> tuple[str, object]:
    try:
        return "ok", x[key]  # type: ignore[index]
    except IndexError:
        return "IndexError", None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(i=st.integers(0, len(SHAPES) - 1), key=indexes())
def test_indexing_matches_numpy(ckpt, i: int, key: object) -> None:  # type: ignore[no-untyped-def]
    t = ckpt[f"t{i}"]
    x = np.asarray(t)
    kind, expected = _numpy_outcome(x, key)
    if kind == "IndexError":
        with pytest.raises(IndexError) as e:
            t[key]
        assert isinstance(e.value, InvalidArgumentError) and e.value.code == "invalid_argument"
        assert e.value.tensor == t.name
        return
    got = t[key]
    assert isinstance(got, torch.Tensor)
    assert tuple(got.shape) == np.shape(expected)
    assert np.array_equal(got.numpy(), expected)


def test_index_errors_are_index_errors(ckpt) -> None:  # type: ignore[no-untyped-def]
    t = ckpt["t5"]  # shape (2, 3, 4)
    with pytest.raises(IndexError, match="index 2 is out of bounds for axis 0 with size 2"):
        t[2]
    with pytest.raises(IndexError, match="index -5 is out of bounds for axis 1 with size 3"):
        t[0, -5]
    with pytest.raises(IndexError, match="too many indices .* 3-dimensional, but 4 were indexed"):
        t[0, 0, 0, 0]
    with pytest.raises(IndexError, match="too many indices"):
        t[..., 0, 0, 0, 0]
    with pytest.raises(IndexError, match="single ellipsis"):
        t[..., ...]
    with pytest.raises(IndexError, match="not an index"):
        t[1.5]
    with pytest.raises(IndexError, match="0-dimensional"):
        ckpt["t0"][0]
    with pytest.raises(ValueError, match="slice step cannot be zero"):
        t[::0]
    with pytest.raises(IndexOutOfRangeError):
        t[2]
    # numpy-valid but not supported: advanced indexing stays an invalid_argument, not an IndexError
    with pytest.raises(InvalidArgumentError, match="advanced indexing") as e:
        t[[0, 1]]
    assert not isinstance(e.value, IndexError)
    # integer scalars of numpy and torch index like ints
    assert torch.equal(t[np.int64(1), torch.tensor(2)], t.read()[1, 2])


def test_asarray_and_as_tensor(ckpt) -> None:  # type: ignore[no-untyped-def]
    for i, shape in enumerate(SHAPES):
        t = ckpt[f"t{i}"]
        a = np.asarray(t)
        assert isinstance(a, np.ndarray) and a.shape == shape and a.dtype == np.float32
        assert np.array_equal(a, t.read().numpy())
        assert torch.equal(torch.as_tensor(t), t.read())
        assert torch.equal(torch.as_tensor(np.asarray(t)), t.read())
        assert torch.equal(torch.from_dlpack(t), t.read())
    i8 = ckpt["i8"]
    assert np.asarray(i8).dtype == np.int8
    assert np.array_equal(np.asarray(i8, dtype=np.float64), np.arange(-3, 3, dtype=np.float64))
    assert np.array(i8, copy=True).dtype == np.int8
    assert np.asarray(i8, copy=False).dtype == np.int8  # a fresh read: no copy is needed
    with pytest.raises(ValueError, match="needs a copy"):
        np.asarray(i8, dtype=np.float32, copy=False)
    assert np.add(np.asarray(ckpt["t1"]), 1).shape == (0,)


def test_bfloat16_has_no_numpy_dtype(ckpt) -> None:  # type: ignore[no-untyped-def]
    bf = ckpt["bf"]
    with pytest.raises(TypeError, match=r"'bf' is torch.bfloat16, which numpy has no dtype for: use .*read\(\)"):
        np.asarray(bf)
    a = np.asarray(bf, dtype=np.float32)
    assert a.dtype == np.float32 and np.array_equal(a, np.arange(6, dtype=np.float32).reshape(2, 3))
    t = torch.as_tensor(bf)  # DLPack carries bfloat16
    assert t.dtype == torch.bfloat16 and torch.equal(t, bf.read())


def test_logical_tensors_index_like_numpy(tmp_path: Path) -> None:
    w = torch.arange(24.0).reshape(8, 3)
    ucl.save_sharded([{"w": w[:4]}, {"w": w[4:]}], tmp_path, 0, layout='ucl-layout 1\nmesh tp=2\n"w": shard(0, tp)\n')
    with ucl.open(tmp_path) as c:
        t = c["w"]
        x = w.numpy()
        for key in [(slice(None, None, -3), 1), (None, slice(6, 1, -2)), -1, (..., None)]:
            assert np.array_equal(t[key].numpy(), x[key])
        assert np.array_equal(np.asarray(t), x)
        with pytest.raises(IndexError):
            t[8]
