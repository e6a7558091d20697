"""Typed values of the structure tree (spec/core.md §5.3 items 4-9): numpy scalars and arrays, bytes, big
integers, argparse.Namespace, RNG states and dataloader states round-trip exactly, without pickle."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from referencing import Registry, Resource

import ucl
from ucl.errors import InvalidArgumentError, SchemaError, UCLError
from ucl.format import dtypes, structure
from ucl.format.metadata import StepMeta

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "spec" / "schemas"


def _tree_validator() -> jsonschema.Validator:
    docs = {p.name: json.loads(p.read_text()) for p in SCHEMA_DIR.glob("*.schema.json")}
    reg = Registry().with_resources(
        [(d["$id"], Resource.from_contents(d)) for d in docs.values()]
        + [(n, Resource.from_contents(d)) for n, d in docs.items()])
    step = docs["step.schema.json"]
    strict = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=(
        jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", lambda _, x: type(x) is int)))
    return strict({"$ref": step["$id"] + "#/$defs/tree"}, registry=reg)


TREE_SCHEMA = _tree_validator()


def roundtrip(obj: Any) -> Any:
    """``{"x": obj}`` through flatten, JSON text, the reader's checks (code and schema) and unflatten."""
    tensors, tree = structure.flatten({"x": obj})
    doc = json.loads(json.dumps(tree, allow_nan=False))
    assert doc == tree
    assert set(structure.iter_tree_tensors(doc)) == set(tensors)
    TREE_SCHEMA.validate(doc)
    return structure.unflatten(doc, tensors)["x"]


def same_bits(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


NUMPY_DTYPES = [dtypes.to_numpy(n) for n in dtypes.SPEC_DTYPES]


def _from_bytes(dt: np.dtype, raw: bytes, shape: tuple[int, ...] | None = None) -> Any:
    if dt == np.bool_:
        raw = bytes(b & 1 for b in raw)
    arr = np.frombuffer(raw, dtype=dt)
    return arr[0] if shape is None else arr.reshape(shape).copy()


# -- numpy -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", NUMPY_DTYPES, ids=str)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_numpy_scalars_of_every_dtype_roundtrip_bit_exact(dt: np.dtype, data: st.DataObject) -> None:
    raw = data.draw(st.binary(min_size=dt.itemsize, max_size=dt.itemsize))
    x = _from_bytes(dt, raw)
    y = roundtrip(x)
    assert same_bits(x, y), (x, y)


@pytest.mark.parametrize("dt", NUMPY_DTYPES, ids=str)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_numpy_arrays_of_every_dtype_roundtrip_bit_exact(dt: np.dtype, data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 5), max_size=3)))
    n = int(np.prod(shape)) * dt.itemsize
    x = _from_bytes(dt, data.draw(st.binary(min_size=n, max_size=n)), shape)
    if data.draw(st.booleans()):
        x = x[::-1] if x.ndim else x  # not contiguous
    y = roundtrip(x)
    assert isinstance(y, np.ndarray) and y.shape == x.shape and same_bits(x, y)
    assert y.flags.writeable


def test_readable_scalars_are_json_numbers_others_their_bytes() -> None:
    assert structure.flatten({"x": np.float32(1.5)})[1]["items"][0][1] == {"t": "numpy", "dtype": "float32", "v": 1.5}
    assert structure.flatten({"x": np.uint64(2**64 - 1)})[1]["items"][0][1]["v"] == 2**64 - 1
    assert structure.flatten({"x": np.bool_(True)})[1]["items"][0][1]["v"] is True
    for x in (np.float32("nan"), np.float64("-inf"), np.complex64(1 + 2j)):
        node = structure.flatten({"x": x})[1]["items"][0][1]
        assert "v" not in node and "b64" in node


def test_numpy_float64_keeps_its_type_and_big_endian_arrays_their_values() -> None:
    y = roundtrip(np.float64(0.1))
    assert type(y) is np.float64 and y == 0.1
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    y = roundtrip(be)
    assert y.dtype == np.int32 and (y == be).all()
    assert np.asarray(roundtrip(np.array(3.5, dtype=ml_dtypes.bfloat16))).dtype == ml_dtypes.bfloat16


def test_large_numpy_arrays_are_stored_as_tensors_and_come_back_as_numpy(tmp_path) -> None:
    small = np.arange(structure.INLINE_BYTES // 8, dtype=np.float64)
    large = np.arange(structure.INLINE_BYTES // 8 + 1, dtype=np.float64)
    bf = np.ones(structure.INLINE_BYTES, dtype=ml_dtypes.bfloat16)
    tensors, tree = structure.flatten({"small": small, "large": large, "bf": bf})
    assert sorted(tensors) == ["bf", "large"]
    ucl.save({"small": small, "large": large, "bf": bf, "u": np.arange(70000, dtype=np.uint16)}, tmp_path, step=1)
    assert sorted(ucl.open(tmp_path).keys()) == ["bf", "large", "u"]
    out = ucl.load(tmp_path)
    for k, v in {"small": small, "large": large, "bf": bf}.items():
        assert isinstance(out[k], np.ndarray) and same_bits(out[k], v), k
    assert out["u"].dtype == np.uint16 and (out["u"] == np.arange(70000, dtype=np.uint16)).all()


# -- other typed values ------------------------------------------------------------------------------------
@given(st.one_of(st.integers(min_value=-(2**300), max_value=2**300), st.binary(max_size=100)))
def test_big_ints_and_bytes_roundtrip(x: Any) -> None:
    y = roundtrip(x)
    assert type(y) is type(x) and y == x


def test_namespace_roundtrips_with_its_nested_values() -> None:
    ns = argparse.Namespace(lr=3e-4, name="run", dims=[1, 2], sub=argparse.Namespace(beta=np.float32(0.9)),
                            seed=None, big=2**65)
    y = roundtrip(ns)
    assert isinstance(y, argparse.Namespace) and vars(y).keys() == vars(ns).keys()
    assert y.lr == ns.lr and y.dims == [1, 2] and y.seed is None and y.big == 2**65
    assert type(y.sub.beta) is np.float32 and y.sub.beta == np.float32(0.9)


def test_tuples_that_only_look_like_a_random_state_stay_tuples() -> None:
    for x in ((3, tuple(range(625)), float("nan")), (3, (1, 2.0) * 312 + (1,), None), (True, (1,) * 625, None)):
        y = roundtrip(x)
        assert type(y) is tuple and y[:2] == x[:2]


# -- RNG states ------------------------------------------------------------------------------------------
def test_python_random_state_continues_identically() -> None:
    r = random.Random(1234)
    r.random()
    r.gauss(0, 1)  # gauss_next set
    state = r.getstate()
    node = structure.flatten({"x": state})[1]["items"][0][1]
    assert node["t"] == "pyrandom" and len(node["state"]) == 625 and node["gauss"] is not None
    s = random.Random()
    s.setstate(roundtrip(state))
    assert [s.random() for _ in range(5)] + [s.gauss(0, 1)] == [r.random() for _ in range(5)] + [r.gauss(0, 1)]


def test_numpy_global_and_generator_states_continue_identically() -> None:
    np.random.seed(7)
    np.random.standard_normal()  # has_gauss set
    legacy, new = np.random.get_state(), np.random.get_state(legacy=False)
    want = np.random.standard_normal(4)
    for st_ in (legacy, new):
        np.random.set_state(roundtrip(st_))
        assert (np.random.standard_normal(4) == want).all()
    for bg in (np.random.MT19937, np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64):
        g = np.random.Generator(bg(99))
        g.random(3)
        state = g.bit_generator.state
        h = np.random.Generator(bg())
        h.bit_generator.state = roundtrip(state)
        assert (h.random(5) == g.random(5)).all() and (h.integers(0, 2**63, 3) == g.integers(0, 2**63, 3)).all(), bg


def test_torch_rng_state_is_a_tensor_and_continues_identically(tmp_path) -> None:
    torch.manual_seed(5)
    torch.rand(3)
    gen = torch.Generator().manual_seed(11)
    ucl.save({"cpu": torch.get_rng_state(), "gen": gen.get_state(), "py": random.getstate(),
              "np": np.random.get_state()}, tmp_path, step=0)
    want = torch.rand(4), torch.rand(4, generator=gen), random.random(), np.random.rand()
    out = ucl.load(tmp_path)
    torch.set_rng_state(out["cpu"])
    gen.set_state(out["gen"])
    random.setstate(out["py"])
    np.random.set_state(out["np"])
    got = torch.rand(4), torch.rand(4, generator=gen), random.random(), np.random.rand()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2:] == want[2:]


# -- dataloader states -----------------------------------------------------------------------------------
def _stateful_loader_like_state() -> dict[str, Any]:
    """What torchdata's StatefulDataLoader.state_dict() looks like (num_workers=2), written by hand."""
    return {"_iterator_finished": False,
            "_snapshot": {"_last_yielded_worker_id": 1,
                          "_main_snapshot": {"_IterableDataset_len_called": None, "_base_seed": 5405953357975995701,
                                             "_index_sampler_state": None, "_num_workers": 2,
                                             "_sampler_iter_state": {"sampler_iter_state": {
                                                 "generator": torch.Generator().manual_seed(3).get_state(),
                                                 "yielded": 4}, "samples_yielded": 4},
                                             "_sampler_iter_yielded": 2, "_shared_seed": None},
                          "_snapshot_step": 2,
                          "_worker_snapshots": {f"worker_{i}": {"dataset_state": None, "fetcher_state": None,
                                                                "worker_id": i} for i in range(2)}},
            "_steps_since_snapshot": 0}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_a_dataloader_state_roundtrips_in_the_state_and_inline(tmp_path) -> None:
    sd = _stateful_loader_like_state()
    ucl.save({"loader": sd}, tmp_path, step=0)
    assert _equal(ucl.load(tmp_path)["loader"], sd)
    node = json.loads(json.dumps(structure.encode_value(sd)))  # per-rank state: the generator inline
    assert _equal(structure.decode_value(node), sd)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_torchdata_stateful_dataloader_resumes_identically(tmp_path) -> None:
    import torchdata.stateful_dataloader as sdl
    data = list(range(40))
    loader = sdl.StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    ucl.save({"loader": loader.state_dict()}, tmp_path, step=0)
    rest = [b.tolist() for b in it]
    again = sdl.StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=0)
    again.load_state_dict(ucl.load(tmp_path)["loader"])
    assert [b.tolist() for b in again] == rest
    inline = structure.decode_value(json.loads(json.dumps(structure.encode_value(loader.state_dict()))))
    assert _equal(inline, loader.state_dict())


# -- refusals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, what", [
    (np.array([object()]), "numpy array of dtype object"),
    (np.datetime64("2026-01-01"), "numpy scalar of dtype datetime64"),
    (np.zeros(2, dtype=[("a", "i4")]), "numpy array of dtype"),
    ({1, 2}, "is a set"),
    (object(), "is a object"),
])
def test_values_ucl_cannot_store_name_their_path_and_type(value: Any, what: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"'a/0/b'.*" + what):
        structure.flatten({"a": [{"b": value}]})


def test_per_rank_values_are_small_and_hold_no_tensor_nodes() -> None:
    node = structure.encode_value({"rng": torch.get_rng_state(), "bf": torch.ones(2, dtype=torch.bfloat16),
                                   "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5)})
    out = structure.decode_value(json.loads(json.dumps(node)))
    assert torch.equal(out["rng"], torch.get_rng_state()) and out["bf"].dtype == torch.bfloat16
    assert out["empty"].shape == (0, 3) and out["scalar"].item() == 2.5
    with pytest.raises(InvalidArgumentError, match="'big'.*bytes"):
        structure.encode_value({"big": torch.zeros(structure.INLINE_BYTES // 4 + 1)})
    with pytest.raises(InvalidArgumentError, match="'arr'.*bytes"):
        structure.encode_value({"arr": np.zeros(structure.INLINE_BYTES + 1, np.uint8)})


B64_0 = "AA=="
BAD_NODES = [
    {"t": "pickle", "v": "gASVAAAA"},
    {"t": "numpy", "dtype": "float32"},
    {"t": "numpy", "dtype": "float32", "v": 1.0, "b64": "AAAAAA=="},
    {"t": "numpy", "dtype": "datetime64", "v": 1},
    {"t": "ndarray", "dtype": "uint8", "shape": [1], "b64": "AA"},
    {"t": "ndarray", "dtype": "uint8", "shape": [-1], "b64": ""},
    {"t": "ndarray", "dtype": "uint8", "shape": [1.0], "b64": B64_0},
    {"t": "ndarray", "dtype": "uint8", "shape": [1], "b64": B64_0, "torch": 1},
    {"t": "bytes", "b64": "not base64!"},
    {"t": "int", "v": 12},
    {"t": "int", "v": "012"},
    {"t": "namespace", "items": [[1, {"t": "value", "v": 1}]]},
    {"t": "pyrandom", "version": 3, "state": [2**32], "gauss": None},
    {"t": "pyrandom", "version": 3, "state": [1]},
    {"t": "tensor", "name": "w", "as": "pickle"},
    {"t": "value", "v": [1]},
]
# rules of the text (§5.3 items 5-6) that the schema does not express: readers check them in code
TEXT_ONLY = [
    {"t": "numpy", "dtype": "int8", "v": 128},
    {"t": "numpy", "dtype": "float16", "v": 0.1},  # not a float16 value
    {"t": "numpy", "dtype": "bool", "v": 1},
    {"t": "numpy", "dtype": "complex64", "v": 1.0},
    {"t": "numpy", "dtype": "bool", "b64": "Ag=="},
    {"t": "numpy", "dtype": "int32", "b64": B64_0},
    {"t": "ndarray", "dtype": "uint8", "shape": [2], "b64": B64_0},
    {"t": "ndarray", "dtype": "bool", "shape": [1], "b64": "Ag=="},
]


@pytest.mark.parametrize("node", BAD_NODES + TEXT_ONLY, ids=lambda n: json.dumps(n)[:60])
def test_readers_refuse_malformed_or_unknown_nodes_with_schema_violation(node: dict[str, Any]) -> None:
    tree = {"t": "dict", "items": [["x", node]]}
    with pytest.raises(SchemaError) as e:
        list(structure.iter_tree_tensors(tree))
    assert e.value.code == "schema_violation"
    assert TREE_SCHEMA.is_valid(tree) == (node in TEXT_ONLY)


def test_a_step_document_with_an_unknown_node_kind_is_schema_violation() -> None:
    doc = {"zarr_format": 3, "node_type": "group",
           "attributes": {"ucl": {"format_version": 1, "step": 0, "kind": "full", "parent": None,
                                  "tree": {"t": "dict", "items": [["x", {"t": "pickle", "v": ""}]]},
                                  "layout": None, "mesh": None}},
           "consolidated_metadata": {"kind": "inline", "must_understand": False, "metadata": {}}}
    with pytest.raises(UCLError) as e:
        StepMeta.from_dict(doc, "steps/0/zarr.json")
    assert e.value.code == "schema_violation"


def test_per_rank_nodes_must_not_name_tensors() -> None:
    tree = structure.with_ranks({"t": "dict", "items": []}, [{"t": "tensor", "name": "w"}])
    with pytest.raises(SchemaError, match="per-rank"):
        list(structure.iter_tree_tensors(tree))
    tree = {"t": "dict", "items": [], "ranks": {"t": "value", "v": 1}}
    with pytest.raises(SchemaError):
        list(structure.iter_tree_tensors(tree))
    good = structure.with_ranks({"t": "dict", "items": []}, [structure.encode_value({"a": np.int8(1)})])
    assert list(structure.iter_tree_tensors(good)) == []
    TREE_SCHEMA.validate(good)
    assert structure.graft(good, ["w"])["ranks"] == good["ranks"]  # a layout step keeps them
