"""ucl.adapters.lightning: Lightning's CheckpointIO through ucl (sync, async, Lightning's AsyncCheckpointIO).

The kill tests fit a tiny MLP in a child process, SIGKILL it after some checkpoints, resume with
``fit(ckpt_path="last")`` in a fresh process and compare the final parameters and optimizer state,
bit for bit, with the same kill and resume through Lightning's own TorchCheckpointIO (Lightning's resume
semantics are the reference: what ucl must give is exactly what torch.save checkpoints give).
"""

from __future__ import annotations

import collections
import enum
import os
from pathlib import Path

import lightning  # noqa: E402,F401  (a test dependency: pyproject.toml [test])
import pytest
import torch

from tests.adapters.killrun import assert_identical, kill_then_resume  # noqa: E402
from ucl.adapters.lightning import UclCheckpointIO  # noqa: E402

DRIVER = str(Path(__file__).with_name("lightning_driver.py"))
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class Color(enum.Enum):
    RED = 1


def checkpoint() -> dict:
    from lightning.fabric.utilities.data import AttributeDict

    sd = collections.OrderedDict(w=torch.randn(3, 4), b=torch.arange(4, dtype=torch.int32))
    sd._metadata = collections.OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return {"epoch": 2, "global_step": 12, "pytorch-lightning_version": "2.6.6", "state_dict": sd,
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}},
                                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "fused": None}]}],
            "callbacks": {"ModelCheckpoint{'monitor': None, 'mode': 'min'}": {
                "best_model_score": torch.tensor(float("inf")), "dirpath": "/x/ckpt",
                "best_k_models": {"/x/a.ckpt": 1.5}}},
            "hyper_parameters": AttributeDict(hidden=16, name="mlp", color=Color.RED),
            "odd": {(1, 2): "tuple key", "": "empty", "a/b": 1.5, 2 ** 70: {1, 2}}, "nan": float("nan")}


def test_round_trip_faithful(tmp_path) -> None:
    io = UclCheckpointIO()
    ck = checkpoint()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(ck, path)
    ck["global_step"] = 13
    io.save_checkpoint(ck, path)  # the same path again: a new step, the old one retained away (keep_last=1)
    got = io.load_checkpoint(path, weights_only=False)
    io.teardown()
    import ucl

    assert ucl.open(path).step == 13 and len(ucl.Repository.open(path).steps()) == 1
    assert type(got["state_dict"]) is collections.OrderedDict and got["state_dict"]._metadata == {"": {"version": 1}}
    assert type(got["hyper_parameters"]).__name__ == "AttributeDict" and got["hyper_parameters"]["color"] is Color.RED
    assert got["odd"][(1, 2)] == "tuple key" and got["odd"][""] == "empty" and got["odd"][2 ** 70] == {1, 2}
    assert got["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(got["state_dict"]["w"], ck["state_dict"]["w"]) and got["state_dict"]["b"].dtype == torch.int32
    st = got["optimizer_states"][0]["state"][0]
    assert torch.equal(st["exp_avg"], ck["optimizer_states"][0]["state"][0]["exp_avg"])
    assert got["nan"] != got["nan"] and got["global_step"] == 13
    # torch's weights_only=True refuses the arbitrary classes (an Enum), as it would for a torch.save file
    with pytest.raises(Exception, match="[Ww]eights"):
        UclCheckpointIO().load_checkpoint(path, weights_only=True)
    meta = UclCheckpointIO().load_checkpoint(path, map_location="meta", weights_only=False)
    assert meta["state_dict"]["w"].device.type == "meta"
    io.remove_checkpoint(path)
    assert not path.exists()


def test_async_returns_before_commit_and_teardown_waits(tmp_path) -> None:
    io = UclCheckpointIO(async_save=True)
    ck = {"global_step": 1, "state_dict": {"w": torch.randn(256, 256)}}
    io.save_checkpoint(ck, tmp_path / "a.ckpt")
    ck["state_dict"]["w"].zero_()  # training moves on: the staged copy is what is saved
    io.teardown()
    got = io.load_checkpoint(tmp_path / "a.ckpt")
    assert got["state_dict"]["w"].abs().sum() > 0


@pytest.fixture(scope="module")
def torch_resumed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torch")
    kill_then_resume([DRIVER, "torch", str(root), str(root / "x.pt")], root, root / "final.pt", 10)
    return root / "final.pt"


# the wrapper variant (Lightning's AsyncCheckpointIO around the sync plugin) runs in ./dev test-long:
# CI keeps under 15 minutes, and sync and async already cover the plugin's two paths
@pytest.mark.parametrize("mode", ["sync", "async", pytest.param("wrapper", marks=pytest.mark.slow)])
def test_kill_and_resume_identical(mode, tmp_path, torch_resumed) -> None:
    kill_then_resume([DRIVER, mode, str(tmp_path), str(tmp_path / "x.pt")], tmp_path, tmp_path / "final.pt", 10)
    assert (tmp_path / "ckpt" / "last.ckpt" / "commits").is_dir()  # the checkpoints were ucl repositories
    assert not (tmp_path / "ckpt" / "last.ckpt").is_file()
    assert_identical(tmp_path / "final.pt", torch_resumed)
    assert os.path.exists(tmp_path / "final.pt")


@pytest.mark.slow  # 2 x 2 Lightning DDP processes, killed and resumed: ~50 s (./dev test-long)
def test_ddp_kill_and_resume_identical(tmp_path) -> None:
    """strategy="ddp" over two CPU processes: Lightning hands only global rank 0's CheckpointIO the
    checkpoint, which saves alone (no collective the other rank would have to join) and asynchronously;
    both ranks are SIGKILLed together (their session), then ``fit(ckpt_path="last")`` on two fresh
    processes equals the same kill and resume through Lightning's TorchCheckpointIO, bit for bit."""
    ref, ours = tmp_path / "torch", tmp_path / "ucl"
    ref.mkdir()
    ours.mkdir()
    two = ["--devices", "2"]
    kill_then_resume([DRIVER, "torch", str(ref), str(ref / "x.pt")], ref, ref / "final.pt", 10, extra=two)
    kill_then_resume([DRIVER, "async", str(ours), str(ours / "x.pt")], ours, ours / "final.pt", 10, extra=two)
    import ucl

    last = ours / "ckpt" / "last.ckpt"
    assert (last / "commits").is_dir() and len(ucl.Repository.open(last).steps()) == 1  # keep_last=1 held
    assert ucl.validate(last).ok
    assert_identical(ours / "final.pt", ref / "final.pt")
