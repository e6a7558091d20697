"""Tensors that are not plain dense CPU/CUDA tensors, through every writer (ucl.save, ucl.save with a layout,
the CheckpointManager with and without a layout).

- Refused before any byte is written, with a UCLError naming the tensor: sparse, nested, quantized, meta,
  fake and other non-strided tensors (InvalidArgumentError), data types outside spec/core.md §4
  (UnsupportedDTypeError). The manager refuses in ``save`` itself, on the caller's thread.
- Stored by their values, bit-exact: conjugate and negative views, non-contiguous and expanded views,
  tensors requiring grad, ``torch.Tensor`` subclasses (``nn.Parameter``, ``nn.Buffer``, plain subclasses).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ucl
from ucl.errors import InvalidArgumentError, UCLError, UnsupportedDTypeError
from ucl.format import structure
from ucl.layout import Layout
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy

WRITERS = ["save", "save-layout", "manager", "manager-layout"]
NAME = "model/layers/0/w"  # every tensor under test sits in a nested dict, next to a plain one


def state_with(t: Any) -> dict[str, Any]:
    return {"model": {"layers": [{"w": t, "b": torch.arange(4.0)}]}, "step": 3}


def write(writer: str, path: Path, state: dict[str, Any], step: int = 1) -> None:
    """Save ``state`` as ``step`` with ``writer``; a manager's background errors are raised too."""
    if writer == "save":
        ucl.save(state, path, step)
    elif writer == "save-layout":
        ucl.save(state, path, step, layout=Layout())
    else:
        layout = Layout() if writer == "manager-layout" else None
        with CheckpointManager(path, layout=layout) as mgr:
            mgr.save(step, state).result()


def bits(t: torch.Tensor) -> list[int]:
    """The bytes of ``t``'s values (the logical values: a conjugate or negative view resolved first)."""
    t = t.detach().resolve_conj().resolve_neg().as_subclass(torch.Tensor)
    if t.is_complex():
        t = torch.view_as_real(t)  # (real, imaginary) float pairs
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def assert_stored(path: Path, want: torch.Tensor, name: str = NAME) -> None:
    """``ucl.load`` and ``ucl.open(path)[name]`` both give ``want``'s values, bit for bit."""
    resolved = want.detach().resolve_conj().resolve_neg()
    loaded = structure.flatten(ucl.load(path))[0][name]
    with ucl.open(path) as ckpt:
        lazy = ckpt[name].read()
    for got in (loaded, lazy):
        assert type(got) is torch.Tensor and not got.is_conj() and not got.is_neg()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bits(got) == bits(resolved), name
        assert torch.equal(got, resolved.as_subclass(torch.Tensor)) or torch.isnan(resolved).any()


def step_files(path: Path) -> list[Path]:
    """The files of every step (a step's directory steps/<S>/), committed or not."""
    return [p for p in (path / "steps").glob("*/**/*") if p.is_file()]


def assert_refused(writer: str, tmp_path: Path, t: Any, error: type[UCLError], code: str,
                   hint: str) -> None:
    """Every writer refuses a state holding ``t`` (at NAME) before writing a byte, naming the tensor."""
    path = tmp_path / "repo"
    if writer.startswith("save"):
        with pytest.raises(error) as ei:
            write(writer, path, state_with(t))
        assert not path.exists(), "ucl.save wrote before refusing"
    else:
        layout = Layout() if writer == "manager-layout" else None
        with CheckpointManager(path, layout=layout) as mgr:
            with pytest.raises(error) as ei:  # by save() itself: not later, from the persister
                mgr.save(1, state_with(t))
            assert step_files(path) == [], "the manager wrote before refusing"
            mgr.save(2, state_with(torch.ones(2, 3))).result()  # the manager still works
            assert step_files(path)
        assert ucl.open(path).step == 2
    e = ei.value
    assert e.code == code and e.tensor == NAME, (e.code, e.tensor, str(e))
    assert repr(NAME) in str(e) and hint in str(e), str(e)


# -- refused: no values, or not dense ----------------------------------------------------------------
def _dense() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _fake() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.ones(2, 3)


def _quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(_dense(), 0.1, 0, torch.qint8)


REFUSED: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "sparse_coo": (lambda: _dense().to_sparse(), ".to_dense()"),
    "sparse_csr": (lambda: _dense().to_sparse_csr(), ".to_dense()"),
    "sparse_csc": (lambda: _dense().to_sparse_csc(), ".to_dense()"),
    "sparse_bsr": (lambda: _dense().to_sparse_bsr((1, 1)), ".to_dense()"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    "nested_jagged": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
                      "nested"),
    "quantized": (_quantized, ".dequantize()"),
    "quantized_per_channel": (lambda: torch.quantize_per_channel(
        _dense(), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0, torch.quint8), ".dequantize()"),
    "meta": (lambda: torch.empty(2, 3, device="meta"), "a meta tensor has no values"),
    "meta_param": (lambda: torch.nn.Parameter(torch.empty(2, 3, device="meta")),
                   "a meta tensor has no values"),
    "fake": (_fake, "no values"),
}
if torch.backends.mkldnn.is_available():
    REFUSED["mkldnn"] = (lambda: _dense().to_mkldnn(), ".to_dense()")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_before_any_byte(tmp_path: Path, writer: str, kind: str) -> None:
    make, hint = REFUSED[kind]
    assert_refused(writer, tmp_path, make(), InvalidArgumentError, "invalid_argument", hint)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("layout", [None, "layout"])
def test_manager_refuses_with_a_cached_plan(tmp_path: Path, layout: str | None) -> None:
    """A sparse or meta tensor of the shape and dtype of the previous save's is refused too (the manager
    caches its plan per set of shapes)."""
    with CheckpointManager(tmp_path, layout=Layout() if layout else None) as mgr:
        mgr.save(1, state_with(_dense())).result()
        for step, t in ((2, _dense().to_sparse()), (3, torch.empty(2, 3, device="meta"))):
            with pytest.raises(InvalidArgumentError) as ei:
                mgr.save(step, state_with(t))
            assert ei.value.tensor == NAME
        mgr.save(4, state_with(_dense() + 1)).result()
    assert ucl.Repository.open(tmp_path).steps() == [1, 4]


@pytest.mark.parametrize("writer", ["save", "manager"])
def test_refused_among_good_tensors_writes_nothing(tmp_path: Path, writer: str) -> None:
    """The refusal comes before the first tensor is written, wherever the bad one is in the state."""
    state = {"a": torch.ones(1000), "b": {"c": torch.ones(10).to_sparse()}, "z": torch.ones(5)}
    if writer == "save":
        with pytest.raises(InvalidArgumentError, match="'b/c'"):
            ucl.save(state, tmp_path / "repo", 1)
        assert not (tmp_path / "repo").exists()
    else:
        with CheckpointManager(tmp_path / "repo") as mgr:
            with pytest.raises(InvalidArgumentError, match="'b/c'"):
                mgr.save(1, state)
            assert step_files(tmp_path / "repo") == []


# -- data types (spec/core.md §4) --------------------------------------------------------------------
SUPPORTED = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
             "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128"]
UNSUPPORTED = [n for n in ["complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                           "float4_e2m1fn_x2", "bits8", "bits16", "uint4", "int4"] if hasattr(torch, n)]


def _of_dtype(name: str) -> torch.Tensor:
    """A tensor of every byte value 0..255 (NaN payloads, signed zeros, subnormals included)."""
    dtype = getattr(torch, name)
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(16)[: 16 * 16 * 4 * 4]
    if dtype == torch.bool:
        return raw[:64].reshape(4, 16) % 2 == 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    return raw[: 48 * itemsize].view(dtype).reshape(3, 16)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("dtype", SUPPORTED)
def test_spec_dtypes_round_trip_bit_exact(tmp_path: Path, writer: str, dtype: str) -> None:
    t = _of_dtype(dtype)
    write(writer, tmp_path, state_with(t))
    assert_stored(tmp_path, t)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("dtype", UNSUPPORTED)
def test_dtypes_outside_the_spec_are_refused(tmp_path: Path, writer: str, dtype: str) -> None:
    dt = getattr(torch, dtype)
    assert_refused(writer, tmp_path, torch.zeros(2, 4, dtype=dt), UnsupportedDTypeError, "unsupported_dtype",
                   str(dt))


# -- stored by value ----------------------------------------------------------------------------------
class PlainSubclass(torch.Tensor):
    pass


class FunctionSubclass(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return super().__torch_function__(func, types, args, kwargs or {})


def _complex(*shape: int, dtype: torch.dtype = torch.complex64) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, dtype=dtype, generator=g)


def _real(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + 1)
    t = torch.randn(*shape, generator=g)
    t.view(-1)[:3] = torch.tensor([-0.0, float("nan"), float("inf")])  # signs and NaNs flip under neg
    return t


BY_VALUE: dict[str, Callable[[], torch.Tensor]] = {
    "conj": lambda: _complex(5, 7).conj(),
    "conj_complex128": lambda: _complex(5, 7, dtype=torch.complex128).conj(),
    "conj_0d": lambda: _complex(1)[0].conj(),
    "conj_empty": lambda: _complex(0, 3).conj(),
    "conj_transposed": lambda: _complex(5, 7).conj().t(),
    "conj_expanded": lambda: _complex(7).conj().expand(5, 7),
    "conj_of_real": lambda: _real(5, 7).conj(),  # a no-op for real tensors
    "neg": lambda: torch._neg_view(_real(5, 7)),
    "neg_0d": lambda: torch._neg_view(_real(3)[1]),
    "neg_strided": lambda: torch._neg_view(_real(10, 7))[::2, 1:],
    "neg_conj": lambda: torch._neg_view(_complex(5, 7).conj()),
    "neg_bf16": lambda: torch._neg_view(_real(5, 7).bfloat16()),
    "transposed": lambda: _real(5, 7).t(),
    "sliced": lambda: _real(10, 14)[1::3, ::2],
    "expanded": lambda: _real(7).expand(5, 7),
    "expanded_0d": lambda: torch.tensor(2.5).expand(3, 4),
    "channels_last": lambda: _real(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "requires_grad": lambda: _real(5, 7).requires_grad_(),
    "non_leaf": lambda: _real(5, 7).requires_grad_() * 2,
    "parameter": lambda: torch.nn.Parameter(_real(5, 7)),
    "parameter_complex_conj": lambda: torch.nn.Parameter(_complex(5, 7)).conj(),
    "plain_subclass": lambda: _real(5, 7).as_subclass(PlainSubclass),
    "function_subclass": lambda: _real(5, 7).as_subclass(FunctionSubclass),
    "subclass_conj": lambda: _complex(5, 7).conj().as_subclass(PlainSubclass),
    "subclass_neg": lambda: torch._neg_view(_real(5, 7)).as_subclass(PlainSubclass),
}
if hasattr(torch.nn, "Buffer"):
    BY_VALUE["buffer"] = lambda: torch.nn.Buffer(_real(5, 7))


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("kind", sorted(BY_VALUE))
def test_stored_by_value(tmp_path: Path, writer: str, kind: str) -> None:
    t = BY_VALUE[kind]()
    write(writer, tmp_path, state_with(t))
    assert_stored(tmp_path, t)
    assert_stored(tmp_path, torch.arange(4.0), "model/layers/0/b")


def test_views_stored_by_value_in_delta_steps(tmp_path: Path) -> None:
    """A manager's delta steps store the values of conjugate and negative views too."""
    c, r = _complex(64, 9), _real(64, 9)
    with CheckpointManager(tmp_path, delta=DeltaPolicy()) as mgr:
        for step in (1, 2, 3):
            c[step] += 1
            r[step] -= 1
            mgr.save(step, {"c": c.conj(), "r": torch._neg_view(r), "t": r.t()}).result()
            assert_stored(tmp_path, c.conj(), "c")
            assert_stored(tmp_path, torch._neg_view(r), "r")
            assert_stored(tmp_path, r.t(), "t")
    assert [ucl.open(tmp_path, s).meta.kind for s in (1, 2, 3)] == ["full", "delta", "delta"]


def test_requires_grad_leaves_of_nested_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    state = {"model": {"weight": model.weight, "nested": {"bias": model.bias, "x": model.weight * 2}}}
    for writer in WRITERS:
        write(writer, tmp_path / writer, state)
        assert_stored(tmp_path / writer, model.weight, "model/weight")
        assert_stored(tmp_path / writer, model.bias, "model/nested/bias")
        assert_stored(tmp_path / writer, model.weight * 2, "model/nested/x")


def test_sparse_gradients_fall_back_to_the_state(tmp_path: Path) -> None:
    """With gradient records on, a save whose gradients are sparse (nn.Embedding(sparse=True)) stores the
    state (full or delta) instead of gradient records, rather than failing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path, delta=DeltaPolicy(gradients=True)) as mgr:
        for step in (1, 2, 3):
            opt.zero_grad()
            model(torch.tensor([[1, 2, 3]])).sum().backward()
            opt.step()
            assert model[0].weight.grad.is_sparse
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, optimizer=opt).result()
    got = structure.flatten(ucl.load(tmp_path))[0]
    for name, want in structure.flatten({"model": model.state_dict()})[0].items():
        assert bits(got[name]) == bits(want), name
    assert all(ucl.open(tmp_path, s).meta.gradient_records is None for s in (1, 2, 3))


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="ucl/delta/gradients.py: GradientTracker._grads (an optimizer step post-hook) "
                          "calls p.grad.data_ptr(), which a sparse gradient lacks: the user's opt.step() "
                          "raises")
def test_sparse_gradients_after_a_save_with_no_gradients(tmp_path: Path) -> None:
    """A save before the first backward (no .grad yet) makes the gradient tracker; the sparse gradients of
    the next optimizer step must not break that step."""
    model = torch.nn.Embedding(20, 4, sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path, delta=DeltaPolicy(gradients=True)) as mgr:
        mgr.save(0, {"model": model.state_dict(), "optim": opt.state_dict()}, optimizer=opt).result()
        model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}, optimizer=opt).result()
    assert bits(ucl.load(tmp_path)["model"]["weight"]) == bits(model.weight)


def test_the_one_check_is_in_the_save_plan() -> None:
    """The check both writers run lives in ucl.plan.save (pure: tests/test_architecture.py keeps ucl.plan
    off ucl.write); a shape-only caller (compaction) uses array_for_shape, which takes no values."""
    from ucl.plan import save as saveplan

    assert saveplan.check_tensor("x", torch.ones(2)) == "float32"
    with pytest.raises(InvalidArgumentError, match="'x'"):
        saveplan.check_tensor("x", torch.ones(2).to_sparse())
    meta = saveplan.array_for_shape("x", (3, 4), torch.bfloat16)
    assert (meta.shape, meta.dtype) == ((3, 4), "bfloat16")
    assert saveplan.array_for_shape("x", (3, 4), "bfloat16") == meta
    with pytest.raises(UnsupportedDTypeError, match="'x'"):
        saveplan.array_for_shape("x", (3,), torch.complex32)


# -- several ranks --------------------------------------------------------------------------------------
def refuse_on_one_rank(rank: int, world: int, path: str, layout: bool) -> dict[str, Any]:
    """Body of each rank (ucl.testing.dist): rank 1 alone holds a sparse tensor at step 1."""
    good = {"w": torch.full((4, 3), float(rank)), "step": 1}
    bad = {"w": torch.full((4, 3), float(rank)).to_sparse() if rank == 1 else torch.zeros(4, 3), "step": 1}
    outcome = "saved"
    with CheckpointManager(path, layout=Layout() if layout else None, mesh="dp=2" if layout else None,
                           timeout=60) as mgr:
        mgr.save(0, good).result()
        try:
            mgr.save(1, bad).result()
        except UCLError as e:
            outcome = f"{e.code} {e.tensor} {e}"
        files = [str(p) for p in step_files(Path(path)) if "/steps/1/" in str(p)]
        mgr.save(2, good).result()  # the ranks still agree on what comes next
        latest = mgr.latest_step()
    return {"outcome": outcome, "files": files, "latest": latest}


def test_a_layout_save_refused_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    """With a layout the ranks plan together: a tensor one rank cannot store fails the save on every rank
    (in save(), before any byte), instead of leaving the others waiting in the plan's collectives."""
    from ucl.testing import dist

    results = dist.run(2, "tests.write.test_tensor_kinds:refuse_on_one_rank", {"path": str(tmp_path),
                                                                                 "layout": True})
    for r in results:
        assert r["outcome"].startswith("invalid_argument w rank 1: tensor 'w' is a sparse tensor"), r
        assert r["files"] == [] and r["latest"] == 2, r
