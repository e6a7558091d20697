"""The public API: one small surface in ucl/__init__.py, and the old module paths as warned aliases."""

from __future__ import annotations

import importlib

import pytest

import ucl


def test_the_public_names() -> None:
    assert set(ucl.__all__) == {
        "AdaptiveInterval", "Checkpoint", "CheckpointManager", "DeltaPolicy", "LazyTensor", "LogicalTensor",
        "Repository", "SaveHandle", "UCLError", "load", "load_into", "open", "save", "save_sharded", "validate",
        "zarr_store"}
    for name in ucl.__all__:
        assert getattr(ucl, name) is not None


def test_one_load_takes_every_option() -> None:
    import inspect

    params = set(inspect.signature(ucl.load).parameters)
    assert {"step", "layout", "mesh", "rank", "tensors", "flat", "approximate", "options"} <= params


@pytest.mark.parametrize(("old", "name", "new"), [
    ("ucl.engine", "CheckpointManager", ucl.CheckpointManager),
    ("ucl.engine", "SaveHandle", ucl.SaveHandle),
    ("ucl.policy", "DeltaPolicy", ucl.DeltaPolicy),
    ("ucl.policy", "AdaptiveInterval", ucl.AdaptiveInterval),
    ("ucl.reshard", "load", ucl.load),
    ("ucl.reshard", "save_sharded", ucl.save_sharded),
])
def test_old_paths_warn_and_resolve(old: str, name: str, new: object) -> None:
    mod = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} is deprecated"):
        assert getattr(mod, name) is new
    with pytest.raises(AttributeError):
        mod.no_such_name  # noqa: B018
