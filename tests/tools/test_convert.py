"""ucl.tools.convert: safetensors (single, directory, Hugging Face sharded), torch.save and DCP imports; export."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ucl
from ucl.errors import CheckpointNotFoundError, InvalidArgumentError, StepExistsError
from ucl.tools.convert import (
    export_safetensors,
    import_checkpoint,
    parse_size,
    read_dcp_metadata,
    source_kind,
)

HF_FILES = [["model.embed.weight", "model.layers.0.attn.w"],
            ["model.layers.0.mlp.w", "model.layers.1.attn.w", "lm_head.weight"],
            ["model.layers.1.mlp.w", "model.norm.weight"]]


def hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    dt = {"model.embed.weight": torch.bfloat16, "model.norm.weight": torch.float16, "lm_head.weight": torch.float32}
    shapes = {"model.embed.weight": (11, 6), "model.norm.weight": (6,), "lm_head.weight": (11, 6)}
    out = {}
    for names in HF_FILES:
        for n in names:
            out[n] = torch.randn(*shapes.get(n, (6, 6)), generator=g).to(dt.get(n, torch.float32))
    out["model.layers.1.attn.w"][0, 0] = float("nan")
    out["model.layers.1.attn.w"][0, 1] = -0.0
    return out


def make_hf_dir(path: os.PathLike[str] | str) -> dict[str, torch.Tensor]:
    """A Hugging Face-style sharded checkpoint: 3 safetensors files and model.safetensors.index.json."""
    os.makedirs(path, exist_ok=True)
    ts = hf_tensors()
    weight_map = {}
    for i, names in enumerate(HF_FILES):
        fname = f"model-{i + 1:05d}-of-{len(HF_FILES):05d}.safetensors"
        save_file({n: ts[n] for n in names}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in ts.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return ts


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.uint8).equal(
        b.contiguous().view(torch.uint8))


def read_dir(path: os.PathLike[str] | str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as fh:
                out.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    return out


def test_hf_sharded_directory_imports_and_exports_back_bit_exactly(tmp_path) -> None:
    src, repo, out = tmp_path / "hf", tmp_path / "repo", tmp_path / "out"
    ts = make_hf_dir(src)
    r = import_checkpoint(src, repo)
    assert (r.step, r.source, r.tensors) == (0, "safetensors", 7)
    assert ucl.validate(repo).ok
    with ucl.open(repo) as ckpt:
        assert set(ckpt.keys()) == set(ts)
        for n, t in ts.items():
            assert bits_equal(ckpt[n].read(), t), n
    e = export_safetensors(repo, out)
    assert e.index == str(out / "model.safetensors.index.json")
    orig_index = json.loads((src / "model.safetensors.index.json").read_text())
    new_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert new_index["weight_map"] == orig_index["weight_map"]
    assert new_index["metadata"]["total_size"] == orig_index["metadata"]["total_size"]
    got = read_dir(out)
    assert set(got) == set(ts) and all(bits_equal(got[n], t) for n, t in ts.items())
    for f in set(orig_index["weight_map"].values()):  # the same files, byte for byte (same tensor order)
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))


def test_export_splits_by_max_shard_size_like_hugging_face(tmp_path) -> None:
    ts = make_hf_dir(tmp_path / "hf")
    import_checkpoint(tmp_path / "hf", tmp_path / "repo")
    e = export_safetensors(tmp_path / "repo", tmp_path / "o", max_shard_size=300)
    names = [os.path.basename(f) for f in e.files]
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    assert all(os.path.getsize(f) < 300 + 1024 for f in e.files)
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"]) == sorted(ts) and set(index["weight_map"].values()) == set(names)
    got = read_dir(tmp_path / "o")
    assert all(bits_equal(got[n], t) for n, t in ts.items())
    one = export_safetensors(tmp_path / "repo", tmp_path / "single.safetensors", max_shard_size=parse_size("5GB"))
    assert one.files == [str(tmp_path / "single.safetensors")] and one.index is None


def test_single_file_and_plain_directory_import(tmp_path) -> None:
    ts = hf_tensors()
    save_file(ts, tmp_path / "one.safetensors", metadata={"k": "v"})
    assert source_kind(tmp_path / "one.safetensors") == "safetensors"
    import_checkpoint(tmp_path / "one.safetensors", tmp_path / "repo", step=5)
    e = export_safetensors(tmp_path / "repo", tmp_path / "back.safetensors")
    assert e.files == [str(tmp_path / "back.safetensors")] and e.index is None
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    d = tmp_path / "plain"
    d.mkdir()
    save_file({"a": ts["lm_head.weight"]}, d / "x.safetensors")
    save_file({"b": ts["model.norm.weight"]}, d / "y.safetensors")
    import_checkpoint(d, tmp_path / "repo", step=6)
    assert ucl.Repository.open(tmp_path / "repo").steps() == [5, 6]
    with pytest.raises(StepExistsError, match="step 6 is already committed"):
        import_checkpoint(d, tmp_path / "repo", step=6)
    import_checkpoint(d, tmp_path / "repo")  # default: after the newest
    assert ucl.Repository.open(tmp_path / "repo").steps() == [5, 6, 7]


def test_torch_save_import_keeps_nesting_and_values(tmp_path) -> None:
    state = {"model": {"w": torch.randn(5, 4), "b": torch.arange(3, dtype=torch.int32)},
             "optim": {"state": {0: {"exp_avg": torch.ones(5, 4)}},
                       "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]},
             "epoch": 3}
    torch.save(state, tmp_path / "ckpt.pt")
    assert source_kind(tmp_path / "ckpt.pt") == "torch"
    r = import_checkpoint(tmp_path / "ckpt.pt", tmp_path / "repo")
    assert (r.source, r.tensors) == ("torch", 3)
    got = ucl.load(tmp_path / "repo")
    assert got["epoch"] == 3 and got["optim"]["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.95)}]
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert torch.equal(got["model"]["b"], state["model"]["b"])
    e = export_safetensors(tmp_path / "repo", tmp_path / "x.safetensors")
    assert e.skipped_values == ["optim.param_groups.0.lr", "optim.param_groups.0.betas.0",
                                "optim.param_groups.0.betas.1", "epoch"]
    assert set(read_dir(tmp_path)) == {"model/w", "model/b", "optim/state/0/exp_avg"}


class Opaque:
    pass


def test_torch_save_with_arbitrary_objects_is_refused(tmp_path) -> None:
    torch.save({"w": torch.ones(2), "obj": Opaque()}, tmp_path / "bad.pt")
    with pytest.raises(InvalidArgumentError, match=r"bad.pt cannot be loaded with weights_only=True: it holds objects "
                       r"other than tensors and plain values \(Unsupported global: GLOBAL "
                       r"tests.tools.test_convert.Opaque\)"):
        import_checkpoint(tmp_path / "bad.pt", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(InvalidArgumentError, match="is not a torch.save file"):
        import_checkpoint(tmp_path / "junk.bin", tmp_path / "repo")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        import_checkpoint(tmp_path / "missing.pt", tmp_path / "repo")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_checkpoint_import(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(6, 4), "e": torch.randn(3).to(torch.bfloat16)}, "step": 9,
             "optim": {"param_groups": [{"lr": 0.5, "params": [0, 1]}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    assert source_kind(tmp_path / "dcp") == "dcp"
    r = import_checkpoint(tmp_path / "dcp", tmp_path / "repo")
    assert (r.source, r.tensors) == ("dcp", 2)
    got = ucl.load(tmp_path / "repo")
    assert got["step"] == 9 and got["optim"] == {"param_groups": [{"lr": 0.5, "params": [0, 1]}]}
    assert bits_equal(got["model"]["w"], state["model"]["w"]) and bits_equal(got["model"]["e"], state["model"]["e"])
    assert ucl.validate(tmp_path / "repo").ok


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_metadata_with_foreign_globals_is_refused(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))
    assert read_dcp_metadata(str(tmp_path / "dcp")).state_dict_metadata["w"].size == torch.Size([2])
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Opaque()))
    with pytest.raises(InvalidArgumentError,
                       match="refers to tests.tools.test_convert.Opaque, which ucl does not unpickle"):
        import_checkpoint(tmp_path / "dcp", tmp_path / "repo")


def test_bad_index_and_dtypes_safetensors_cannot_hold(tmp_path) -> None:
    d = tmp_path / "hf"
    make_hf_dir(d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.norm.weight"] = "../evil.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(InvalidArgumentError, match="names a file '../evil.safetensors' outside its directory"):
        import_checkpoint(d, tmp_path / "repo")
    ucl.save({"z": torch.ones(2, dtype=torch.complex128)}, tmp_path / "c", step=0)
    with pytest.raises(InvalidArgumentError, match="tensor 'z' is complex128, which safetensors cannot hold"):
        export_safetensors(tmp_path / "c", tmp_path / "z.safetensors")
    assert not (tmp_path / "z.safetensors").exists()


def test_header_is_aligned_and_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("123") == 123
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(bad)


def test_export_header_is_8_byte_aligned(tmp_path) -> None:
    ucl.save({"a": torch.ones(3, dtype=torch.int8)}, tmp_path / "r", step=0)
    export_safetensors(tmp_path / "r", tmp_path / "a.safetensors")
    raw = (tmp_path / "a.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and json.loads(raw[8 : 8 + n]) == {"__metadata__": {"format": "pt"},
                                                         "a": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]}}
