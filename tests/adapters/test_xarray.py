"""xarray opens ucl steps: a step directory directly (its array documents carry dimension_names) and any
step (delta, layout) through ``ucl.zarr_store``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray  # noqa: E402  (a test dependency: pyproject.toml [test])

import ucl
from ucl.format.metadata import ArrayMeta, dimension_names


def state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)},
        "opt": {"state": {"0": {"exp_avg": torch.randn(6, 5, generator=g), "step": torch.tensor(3.0)}}},
        "scale": torch.randn(4, generator=g),
    }


def _equal(ds: object, group: dict[str, torch.Tensor]) -> None:
    assert sorted(ds.data_vars) == sorted(group)  # type: ignore[attr-defined]
    for name, t in group.items():
        got = np.asarray(ds[name].values)  # type: ignore[index]
        assert got.shape == tuple(t.shape), name
        assert np.array_equal(got, t.numpy()), name


def test_written_array_documents_name_their_dimensions(tmp_path: Path) -> None:
    ucl.save(state(0), tmp_path / "c", step=1)
    doc = json.loads((tmp_path / "c/steps/1/model/w/zarr.json").read_text())
    assert doc["dimension_names"] == ["model/w/dim0", "model/w/dim1"]
    step_doc = json.loads((tmp_path / "c/steps/1/zarr.json").read_text())
    assert step_doc["consolidated_metadata"]["metadata"]["model/w"] == doc
    assert json.loads((tmp_path / "c/steps/1/opt/state/0/step/zarr.json").read_text())["dimension_names"] == []


def test_documents_without_dimension_names_still_read() -> None:
    meta = ArrayMeta(name="a/b", shape=(4, 2), dtype="float32", chunk_shape=(4, 2), inner_chunk_shape=(4, 2))
    doc = meta.to_dict()
    assert doc["dimension_names"] == dimension_names("a/b", 2)
    old = {k: v for k, v in doc.items() if k != "dimension_names"}
    assert ArrayMeta.from_dict(old, "old") == meta == ArrayMeta.from_dict(doc, "new")
    assert ArrayMeta.from_dict({**doc, "dimension_names": ["rows", None]}, "other") == meta


@pytest.mark.parametrize("consolidated", [True, False])
def test_open_zarr_on_a_step_directory(tmp_path: Path, consolidated: bool) -> None:
    s = state(0)
    ucl.save(s, tmp_path / "c", step=1)
    step_dir = tmp_path / "c/steps/1"
    _equal(xarray.open_zarr(step_dir, group="model", consolidated=consolidated), s["model"])  # type: ignore[arg-type]
    _equal(xarray.open_zarr(step_dir, consolidated=consolidated), {"scale": s["scale"]})  # type: ignore[dict-item]
    ds = xarray.open_zarr(step_dir, group="opt/state/0", consolidated=consolidated)
    _equal(ds, s["opt"]["state"]["0"])  # type: ignore[index]
    assert ds["exp_avg"].dims == ("opt/state/0/exp_avg/dim0", "opt/state/0/exp_avg/dim1")
    tree = xarray.open_datatree(step_dir, engine="zarr", consolidated=consolidated)
    assert np.array_equal(tree["model"]["w"].values, s["model"]["w"].numpy())  # type: ignore[index]


def test_open_zarr_through_zarr_store_of_a_delta_step(tmp_path: Path) -> None:
    path = tmp_path / "c"
    s = state(0)
    with ucl.CheckpointManager(path, delta=ucl.DeltaPolicy(full_every=4)) as mgr:
        mgr.save(0, s)
        mgr.wait()
        s["model"]["w"][:2] += 1.0  # type: ignore[index]
        s["scale"] = s["scale"] * 2  # type: ignore[operator]
        mgr.save(1, s)
    assert ucl.open(path, 1).meta.kind == "delta"
    for step in (0, 1):
        with ucl.zarr_store(path, step) as store:
            _equal(xarray.open_zarr(store, group="model"), s["model"] if step else state(0)["model"])  # type: ignore[arg-type]
            want = s["scale"] if step else state(0)["scale"]
            _equal(xarray.open_zarr(store), {"scale": want})  # type: ignore[dict-item]
            tree = xarray.open_datatree(store, engine="zarr")
            assert np.array_equal(tree["opt/state/0"]["exp_avg"].values,
                                  s["opt"]["state"]["0"]["exp_avg"].numpy())  # type: ignore[index]


def test_open_zarr_through_zarr_store_of_a_layout_step(tmp_path: Path) -> None:
    w = torch.randn(8, 3)
    emb = torch.randn(5, 2)
    halves = [{"w": w[:4], "emb": emb}, {"w": w[4:], "emb": emb}]
    ucl.save_sharded(halves, tmp_path / "c", 0, layout='ucl-layout 1\nmesh tp=2\n"w": shard(0, tp)\n"emb": replicate\n')
    with ucl.zarr_store(tmp_path / "c") as store:
        ds = xarray.open_zarr(store)
        _equal(ds, {"w": w, "emb": emb})
        assert ds["w"].dims == ("w/dim0", "w/dim1")
