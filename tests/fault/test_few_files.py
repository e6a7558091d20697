"""Every tool under a low limit of open files (soft RLIMIT_NOFILE): a repository of many small tensors, a
file each, saved, delta-saved, validated, loaded and mounted as a zarr store with at most 48 descriptors
free (the default limit is often 1,024; a step of thousands of tensors is thousands of files)."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zarr

import ucl
from ucl.io import fds

N = 600


@pytest.fixture()
def few_files() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds.in_use() + 48, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_every_tool_works_with_few_descriptors_free(tmp_path: Path, few_files: None) -> None:
    g = torch.Generator().manual_seed(3)
    st = {f"t{i}": torch.randn(2000, generator=g) for i in range(N)}
    later = {k: v + 1 if k < "t3" else v for k, v in st.items()}  # about a third changed
    ucl.save(st, tmp_path / "r", step=0)
    with ucl.CheckpointManager(tmp_path / "m", delta=ucl.DeltaPolicy()) as m:
        m.save(1, st)
        m.save(2, later)
        m.wait()
    assert ucl.validate(tmp_path / "r").ok and ucl.validate(tmp_path / "m").ok
    with ucl.open(tmp_path / "m") as ck:
        assert ck.kind == "delta"
        got = ck.load(flat=True)
    assert all(torch.equal(got[k], v) for k, v in later.items())
    out = {k: torch.empty_like(v) for k, v in st.items()}
    ucl.load_into(tmp_path / "r", out)
    assert all(torch.equal(out[k], v) for k, v in st.items())
    group = zarr.open_group(ucl.zarr_store(tmp_path / "m"), mode="r")
    for k in ("t0", "t299", f"t{N - 1}"):
        assert torch.equal(torch.from_numpy(group[k][:]), later[k]), k
