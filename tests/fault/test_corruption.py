"""Random corruption of a real repository: every one is detected, no read returns wrong data.

Each trial copies a repository written by the engine (full and delta steps, nested names, bfloat16),
damages one file (a bit flip, a truncation, a deletion, an inserted byte) and checks that
``ucl.validate`` reports it and that reading every step either raises a UCLError or returns exactly
what was saved. Deleting a commit record is not damage but the removal of a step (what a writer that
died before committing leaves): that step is then not found, and nothing else changes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

import ucl
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return (t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy().tobytes()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("pristine") / "repo"
    g = torch.Generator().manual_seed(7)
    state = {"model": {"emb": torch.randn(300, 16, generator=g), "ln": torch.randn(16, generator=g).bfloat16()},
             "optim": {"m": torch.randn(300, 16, generator=g), "step": torch.tensor(0)}}
    saved = {}
    from ucl.options import WriteOptions

    # several inner chunks per shard
    with CheckpointManager(root, delta=DeltaPolicy(full_every=3), options=WriteOptions(inner_chunk_bytes=4096)) as mgr:
        for step in range(4):
            saved[step] = ucl.format.structure.flatten(state)[0]
            saved[step] = {k: v.clone() for k, v in saved[step].items()}
            mgr.save(step, state)
            state["model"]["emb"][step * 7] += 1
            state["optim"]["m"].mul_(0.5)
            state["optim"]["step"] += 1
        mgr.wait()
    assert ucl.validate(root).ok
    return root, saved


def corrupt(repo: Path, rng: random.Random) -> str:
    files = sorted(p for p in repo.rglob("*") if p.is_file() and p.name != ".ucl-writer.lock")
    f = rng.choice(files)
    data = bytearray(f.read_bytes())
    kind = rng.choice(["flip", "flip", "flip", "truncate", "delete", "insert"])
    rel = str(f.relative_to(repo))
    if kind == "delete" or not data:
        f.unlink()
        return f"delete {rel}"
    at = rng.randrange(len(data))
    if kind == "flip":
        data[at] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[at:]
    else:
        data.insert(at, rng.randrange(256))
    f.write_bytes(bytes(data))
    return f"{kind} {rel} at {at}"


def trials(tmp_path: Path, pristine, n: int, seed: int) -> dict[str, int]:
    src, saved = pristine
    rng = random.Random(seed)
    stats = {"corruptions": 0, "detected": 0, "steps_removed": 0, "unchanged_record": 0, "reads_refused": 0,
             "reads_exact": 0}
    for i in range(n):
        repo = tmp_path / f"t{i}"
        shutil.copytree(src, repo, symlinks=True)
        what = corrupt(repo, rng)
        stats["corruptions"] += 1
        report = ucl.validate(repo)
        if _same_json_document(src, repo, what):
            # whitespace inserted between the JSON tokens of a commit record (whose checksum covers the
            # canonical JSON, spec/core.md §7) or of a group document: unchanged, not damaged
            assert report.ok, f"an unchanged document reported invalid: {what}"
            stats["unchanged_record"] += 1
        elif what.startswith("delete commits/"):
            # not damage but a step removed (the state a writer that died before committing leaves):
            # the step is gone and its delta children with it, the rest stays valid and exact
            step = int(what.split("/")[-1].split(".")[0])
            with pytest.raises(ucl.errors.CheckpointNotFoundError):
                ucl.open(repo, step)
            stats["steps_removed"] += 1
        else:
            assert not report.ok, f"undetected: {what}"
            stats["detected"] += 1
        for step, want in saved.items():
            try:
                got = ucl.load(repo, step, flat=True)
            except ucl.UCLError:
                stats["reads_refused"] += 1
                continue
            assert got.keys() == want.keys(), what
            for k in want:
                assert bits(got[k]) == bits(want[k]) and got[k].dtype == want[k].dtype, f"wrong data after {what}"
            stats["reads_exact"] += 1
        shutil.rmtree(repo)
    return stats


def _same_json_document(src: Path, repo: Path, what: str) -> bool:
    kind, rel = what.split()[:2]
    # the documents no commit record lists (the repository's and the steps group's, commit records):
    # their meaning is their parsed JSON; every other file is covered byte for byte by a commit record
    if kind == "delete" or not (rel.startswith("commits/") or rel in ("zarr.json", "steps/zarr.json")):
        return False
    try:
        return json.loads((repo / rel).read_bytes()) == json.loads((src / rel).read_bytes())
    except ValueError:
        return False


def test_every_random_corruption_is_detected(tmp_path, pristine) -> None:
    stats = trials(tmp_path, pristine, n=120, seed=2026)
    print(json.dumps(stats))
    assert stats["detected"] + stats["steps_removed"] + stats["unchanged_record"] == stats["corruptions"] == 120
    assert stats["reads_refused"] > 0


@pytest.mark.slow
def test_every_random_corruption_is_detected_long(tmp_path, pristine) -> None:
    stats = trials(tmp_path, pristine, n=2000, seed=int.from_bytes(os.urandom(4), "little"))
    print(json.dumps(stats))
    assert stats["detected"] + stats["steps_removed"] + stats["unchanged_record"] == stats["corruptions"] == 2000
