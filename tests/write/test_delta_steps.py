"""Delta steps written by the engine, read back through their chains (spec/delta.md)."""

from __future__ import annotations

import tempfile

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import ucl
from ucl.errors import DeltaChainError
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy

SPECIALS = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-40, 3.4e38]


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return (t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy().tobytes()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and bits(a[k]) == bits(b[k]) for k in a)


@st.composite
def state_sequences(draw):
    n_steps = draw(st.integers(2, 6))
    rows = draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    state = {
        "w": torch.randn(rows, 7, generator=g),
        "bf": torch.randn(rows + 3, generator=g).bfloat16(),
        "frozen": torch.randn(5, 3, generator=g),
        "i": torch.randint(0, 100, (4,), generator=g),
        "flag": torch.tensor([True, False]),
        "exp_avg_sq": torch.rand(rows, generator=g),
    }
    flat = state["w"].view(-1)
    for k in range(min(len(SPECIALS), flat.numel())):
        flat[k] = SPECIALS[k]
    seq = []
    for _ in range(n_steps):
        seq.append({k: v.clone() for k, v in state.items()})
        op = draw(st.sampled_from(["rows", "all", "bits", "none"]))
        if op == "rows":
            r = draw(st.integers(0, rows - 1))
            state["w"][r] += 1.0
        elif op == "all":
            state["exp_avg_sq"].mul_(0.9)
            state["bf"].add_(0.5)
        elif op == "bits":  # flip a raw bit pattern, NaN payloads included
            v = state["w"].view(torch.int32).view(-1)
            v[draw(st.integers(0, v.numel() - 1))] ^= 1 << draw(st.integers(0, 31))
        state["i"] += draw(st.integers(0, 2))
        state["flag"] = ~state["flag"] if draw(st.booleans()) else state["flag"]
    policy = draw(st.sampled_from([DeltaPolicy(), DeltaPolicy(full_every=3), DeltaPolicy(max_chain=2),
                                   DeltaPolicy(full_every=None, base="previous"),
                                   DeltaPolicy(full_every=3, max_chain=2, base="previous"),
                                   DeltaPolicy(max_chain=0)]))
    return seq, policy


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_sequences())
def test_any_sequence_reconstructs_bit_exactly(case) -> None:
    seq, policy = case
    with tempfile.TemporaryDirectory() as d:
        with CheckpointManager(d, delta=policy) as mgr:
            for step, s in enumerate(seq):
                mgr.save(step, s)
            mgr.wait()
        repo = ucl.Repository.open(d)
        kinds = [repo.commit_record(s).kind for s in range(len(seq))]
        assert kinds[0] == "full"
        if policy.max_chain == 0:
            assert set(kinds) == {"full"}
        for step, s in enumerate(seq):
            assert same(ucl.load(d, step, flat=True), s), (step, kinds)
            with ucl.open(d, step) as ck:  # slices through the chain too
                assert bits(ck["w"][1:, 2:5]) == bits(s["w"][1:, 2:5])
        assert ucl.validate(d).ok


def test_unchanged_tensors_cost_nothing(tmp_path) -> None:
    frozen = {f"layer{i}": torch.randn(256, 256) for i in range(4)}
    live = {"head": torch.randn(256, 256)}
    with CheckpointManager(tmp_path, delta=True) as mgr:
        mgr.save(0, {**frozen, **live}).result()
        live["head"][0, 0] += 1
        rec = mgr.save(1, {**frozen, **live}).result()
    assert rec is not None and rec.kind == "delta"
    data = {k: v for k, v in rec.files.items() if "/c" in k}
    assert all(k.startswith("head/") for k in data)  # frozen layers: no shard files
    assert sum(s for s, _ in data.values()) < 2000  # one changed element: a tiny chunk
    meta = ucl.open(tmp_path).meta
    assert meta.arrays["layer0"].delta == {"mode": "unchanged", "base_step": 0}
    assert meta.arrays["head"].delta == {"mode": "chunked", "base_step": 0, "encoding": "xor"}


def test_a_corrupt_base_fails_every_dependent_step_naming_the_base(tmp_path) -> None:
    s = {"w": torch.randn(64, 64)}
    with CheckpointManager(tmp_path, delta=True) as mgr:
        for step in range(4):
            mgr.save(step, s)
            s["w"][step] += 1
        mgr.wait()
    shard = tmp_path / "steps" / "0" / "w" / "c" / "0" / "0"
    b = bytearray(shard.read_bytes())
    b[100] ^= 0xFF
    shard.write_bytes(b)
    report = ucl.validate(tmp_path)
    bad_steps = {p.step for p in report.problems}
    assert bad_steps == {0, 1, 2, 3}
    for p in report.problems:
        if p.step != 0:
            assert p.code == "broken_chain" and "step 0" in p.message, p
    with pytest.raises(ucl.UCLError, match="crc32c"):
        ucl.load(tmp_path, 3)


def test_retention_keeps_the_bases_of_kept_deltas(tmp_path) -> None:
    with CheckpointManager(tmp_path, delta=DeltaPolicy(full_every=4), keep_last=2) as mgr:
        for step in range(7):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        mgr.wait()
    steps = ucl.Repository.open(tmp_path).steps()
    # 5 and 6 are kept; they are deltas of 4 (full), so 4 stays; 0-3 go
    assert steps == [4, 5, 6]
    for s in (5, 6):
        assert torch.equal(ucl.load(tmp_path, s)["w"], torch.full((8,), float(s)))


def test_missing_parent_is_a_broken_chain(tmp_path) -> None:
    with CheckpointManager(tmp_path, delta=DeltaPolicy(base="previous")) as mgr:  # step 2's parent is step 1
        for step in range(3):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        mgr.wait()
    (tmp_path / "commits" / "1.json").unlink()
    with pytest.raises(DeltaChainError, match="step 1 .*parent of step 2.* not"):
        ucl.load(tmp_path, 2)
    assert {p.code for p in ucl.validate(tmp_path, 2).problems} == {"broken_chain"}
