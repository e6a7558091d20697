"""ucl steps read by the newest zarr that pyproject.toml admits (zarr 3.4, which needs Python >= 3.12),
in the Python 3.13 environment that .ci/current-zarr-env builds (`./dev test` builds it beside the tests;
this test waits for it): every stored array of native steps, bit for bit, with ucl's bfloat16/float8 found
through its entry points.
The whole suite runs with zarr 3.1 on Python 3.11; this is the part of the claimed range it cannot run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import ucl
from ucl.format import names
from ucl.format.dtypes import from_torch
from ucl.options import WriteOptions

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("UCL_CURRENT_ZARR_ROOT", REPO / ".cache" / "current-zarr"))
FIXTURES = REPO / "conformance" / "fixtures" / "valid"
# native steps among the conformance fixtures: no delta, layout or composite records
NATIVE_FIXTURES = ["dtypes", "multi_shard", "names", "rounded_grid", "shapes", "zstd",
                   "zstd_without_content_size", "tree_depth_32", "largest_step", "ignorable_extensions"]


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return (t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy().tobytes()


def patterns(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads included: compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape, dtype=np.int64))
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def written_steps(tmp: Path) -> dict[Path, dict[str, torch.Tensor]]:
    """Steps ucl writes, with what each stores: every dtype, vocabulary shapes (rounded grids), names
    needing escapes, a scalar, zstd, several shards."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float64]
    state = {f"dtypes/{str(d).split('.')[1]}": patterns((37, 5), d, i) for i, d in enumerate(dtypes)}
    state.update({
        "model/embed.weight": patterns((50257, 16), torch.float32, 100),
        "model/lm_head.weight": patterns((32001, 8), torch.bfloat16, 101),
        "model/layers.0.attn/q k%v": patterns((7, 3), torch.float32, 102),
        "step": torch.tensor(17, dtype=torch.int64),
    })
    small = WriteOptions(inner_chunk_bytes=64 << 10)  # several inner chunks per shard, rounded grids
    out = {}
    ucl.save(state, tmp / "plain", step=3, options=small)
    out[tmp / "plain" / "steps" / "3"] = state
    ucl.save(state, tmp / "zstd", step=4, compression="zstd", options=small)
    out[tmp / "zstd" / "steps" / "4"] = state
    return out


def expected_from(state: dict[str, torch.Tensor]) -> dict[str, list]:
    """key path -> [shape, spec dtype name, sha256 of the bytes], as the reader reports it."""
    exp = {}
    for name, t in state.items():
        arr = t if t.dim() else t.reshape(())
        exp[names.to_key(name)] = [list(arr.shape), from_torch(t.dtype), hashlib.sha256(bits(t)).hexdigest()]
    return exp


def expected_fixture(repo: Path) -> dict[Path, dict[str, list]]:
    """Each committed step of a fixture repository, as ucl reads it (names -> key paths)."""
    out = {}
    for step in ucl.Repository.open(repo).steps():
        with ucl.open(repo, step) as ck:
            out[repo / "steps" / str(step)] = {
                names.to_key(n): [list(ck[n].shape), from_torch(ck[n].dtype),
                                  hashlib.sha256(bits(ck[n][...])).hexdigest()] for n in ck}
    return out


def wait_for_builder(limit_s: float = 900.0) -> None:
    """`./dev test` builds the environment beside the tests: while its marker names a live process, the
    build is under way (a marker left by a killed run names a dead one and is not waited for)."""
    marker = Path(f"{ROOT}.building")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            pid = int(marker.read_text().strip() or 0)
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return
        time.sleep(0.5)
    pytest.fail(f"{marker}: .ci/current-zarr-env still building after {limit_s:.0f} s")


def read_with_current_zarr(steps: list[Path], staging: Path) -> dict:
    """Copy the steps into the environment's root (a chroot sees only its own tree), read them there."""
    wait_for_builder()
    python = ROOT / "opt" / "venv" / "bin" / "python"
    assert python.exists(), (f"no Python 3.13 + current zarr environment at {ROOT}: `./dev test` builds it "
                             f"with .ci/current-zarr-env (needs root and Debian's and PyPI's registries; its "
                             f"log: {ROOT.parent / 'current-zarr-env.log'}, {ROOT}.log)")
    inside = ROOT / "tmp" / staging.name
    shutil.rmtree(inside, ignore_errors=True)
    where = []
    for i, s in enumerate(steps):
        dst = inside / str(i)
        shutil.copytree(s, dst)
        where.append(f"/tmp/{staging.name}/{i}")
    shutil.copy(REPO / "tests" / "read" / "current_zarr_reader.py", inside / "reader.py")
    try:
        chroot = shutil.which("chroot", path="/usr/sbin:/usr/bin:/sbin:/bin") or "chroot"
        run = subprocess.run([chroot, str(ROOT), "/opt/venv/bin/python", f"/tmp/{staging.name}/reader.py"],
                             input=json.dumps({"steps": where}), capture_output=True, text=True, timeout=300,
                             env={"PATH": "/usr/bin:/bin", "HOME": "/root"})
        assert run.returncode == 0, run.stderr[-4000:]
        got = json.loads(run.stdout)
    finally:
        shutil.rmtree(inside, ignore_errors=True)
    got["steps"] = {steps[int(k.rsplit("/", 1)[1])]: v for k, v in got["steps"].items()}
    return got


def test_steps_read_by_current_zarr(tmp_path: Path) -> None:
    expected: dict[Path, dict[str, list]] = {}
    for step_dir, state in written_steps(tmp_path).items():
        expected[step_dir] = expected_from(state)
    for fx in NATIVE_FIXTURES:
        expected.update(expected_fixture(FIXTURES / fx))
    got = read_with_current_zarr(list(expected), tmp_path)
    major, minor = (int(x) for x in got["zarr"].split(".")[:2])
    assert (major, minor) >= (3, 4) and tuple(int(x) for x in got["python"].split(".")[:2]) >= (3, 12), got["zarr"]
    for step_dir, exp in expected.items():
        seen = got["steps"][step_dir]
        assert sorted(seen) == sorted(exp), step_dir
        for key, want in exp.items():
            assert seen[key] == want, (step_dir, key)


def test_the_same_steps_read_by_this_zarr(tmp_path: Path) -> None:
    """The reference side: zarr 3.1 here reads what the environment's zarr 3.4 must (and the data types'
    names agree with ucl's through the same entry points)."""
    assert zarr.__version__.startswith("3.")
    from ucl.format.dtypes import register_zarr_dtypes

    register_zarr_dtypes()  # zarr 3.1 never loads data-type entry points (zarr >= 3.4 does: the other test)
    sys.path.insert(0, str(REPO / "tests" / "read"))
    try:
        import current_zarr_reader  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    for step_dir, state in written_steps(tmp_path).items():
        seen = current_zarr_reader.read_step(str(step_dir))
        assert seen == expected_from(state)
