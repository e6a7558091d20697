"""Composite steps (spec/delta.md §9): DeltaPolicy(prune=Prune(...)), written by the engine, read back.

Properties: with the threshold at 0 a composite policy stores exactly what lossless deltas store (the same
files, bit for bit); with any policy every stale reference is younger than max_age and reads give the
referenced step's values bit for bit (the stored groups: the step's own); references never point to a
deleted step after retention or compaction. Readers refuse a composite step unless approximate=True.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings

import ucl
from ucl.errors import (
    ApproximateStepError,
    ApproximateWarning,
    InconsistentMetadataError,
    InvalidArgumentError,
    SchemaError,
)
from ucl.format.metadata import StepMeta
from ucl.format.records import Composite, DeltaRecord
from ucl.tools.compact import compact
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy
from ucl.write.prune import Prune, group_map

NAMES = ["model/layers.0.w", "model/layers.0.b", "model/layers.1.w", "model/layers.1.b", "model/head.w",
         "optim/state/0/exp_avg", "optim/state/0/step", "count"]
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def bits(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def initial(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(12, 5, generator=g) if n.endswith(".w") else torch.randn(5, generator=g)
           for n in NAMES[:6]}
    out["optim/state/0/step"] = torch.tensor(1.0)
    out["count"] = torch.tensor([3], dtype=torch.int64)
    out["model/layers.1.b"][0] = 0.0
    return out


@st.composite
def runs(draw, max_steps: int = 7):
    """``(steps, states)``: increasing step numbers and the state saved at each."""
    n = draw(st.integers(2, max_steps))
    state = initial(draw(st.integers(0, 2**31)))
    steps, states = [], []
    step = draw(st.integers(0, 3))
    for _ in range(n):
        steps.append(step)
        states.append({k: v.clone() for k, v in state.items()})
        step += draw(st.integers(1, 3))
        for name in NAMES:
            op = draw(st.sampled_from(["none", "tiny", "big", "one", "signzero"]))
            t = state[name]
            if op == "none":
                continue
            if t.dtype == torch.int64:
                t += 1
            elif op == "tiny":
                t.mul_(1.0 + 1e-4)
            elif op == "big":
                t.add_(torch.full_like(t, 0.5))
            elif op == "one":
                t.view(-1)[0] += 1.0
            elif name == "model/layers.1.b":
                t[0] = -0.0 if bits(t[0:1]) == bits(torch.zeros(1)) else 0.0  # only the sign bit changes
    return steps, states


def save_all(path: str, policy: DeltaPolicy, steps: list[int], states: list[dict[str, torch.Tensor]],
             **kw) -> None:
    with CheckpointManager(path, delta=policy, **kw) as mgr:
        for s, st_ in zip(steps, states, strict=True):
            mgr.save(s, st_).result()


def load(path: str, step: int) -> tuple[dict[str, torch.Tensor], Composite | None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ApproximateWarning)
        with ucl.open(path, step, approximate=True) as ckpt:
            return ckpt.load(flat=True), ckpt.composite


# -- the acceptance properties -----------------------------------------------------------------------
@SETTINGS
@given(runs(), st.integers(1, 5), st.integers(1, 4))
def test_threshold_zero_stores_exactly_what_lossless_deltas_store(run, full_every, max_age):
    steps, states = run
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        save_all(a, DeltaPolicy(base="previous", full_every=full_every), steps, states)
        prune = Prune(threshold=0, max_age=max_age)
        save_all(b, DeltaPolicy(base="previous", full_every=full_every, prune=prune), steps, states)
        ra, rb = ucl.Repository.open(a), ucl.Repository.open(b)
        assert ra.steps() == rb.steps() == steps
        for s, want in zip(steps, states, strict=True):
            ca, cb = ra.commit_record(s), rb.commit_record(s)
            assert (ca.kind, ca.parent, ca.files) == (cb.kind, cb.parent, cb.files), s  # same bytes on disk
            ma, mb = ra.step_meta(s, ca), rb.step_meta(s, cb)
            assert {n: x.delta for n, x in ma.arrays.items()} == {n: x.delta for n, x in mb.arrays.items()}
            assert mb.composite is None
            got = ucl.load(b, s, flat=True)  # exact: no approximate=True needed
            assert got.keys() == want.keys() and all(bits(got[k]) == bits(want[k]) for k in want), s


@SETTINGS
@given(runs(), st.sampled_from([0.0, 1e-5, 1e-3, 0.05, 0.5, 10.0]), st.sampled_from([None, 1, 2]),
       st.integers(1, 4), st.integers(1, 6))
def test_stale_groups_are_younger_than_max_age_and_read_as_their_step(run, threshold, top_k, max_age,
                                                                      full_every):
    steps, states = run
    prune = Prune(threshold=threshold, top_k=top_k, max_age=max_age)
    by_step = dict(zip(steps, states, strict=True))
    with tempfile.TemporaryDirectory() as d:
        save_all(d, DeltaPolicy(base="previous", full_every=full_every, prune=prune), steps, states)
        groups = {n: g for n, (g, _) in group_map(prune, NAMES).items()}
        last_stored: dict[str, int | None] = dict.fromkeys(set(groups.values()))
        for s in steps:
            got, comp = load(d, s)
            stale = comp.tensors() if comp is not None else {}
            event("a composite step with stale groups" if stale else "a step without stale groups")
            for n in NAMES:
                if n in stale:
                    g = stale[n]
                    assert g.group == groups[n] and g.age == s - g.base_step
                    assert 1 <= g.age < max_age  # the staleness bound
                    assert g.base_step == last_stored[g.group]  # the step that carries its values
                    assert bits(got[n]) == bits(by_step[g.base_step][n])
                else:
                    assert bits(got[n]) == bits(by_step[s][n]), (s, n)
            for g in last_stored:
                if g not in {x.group for x in (comp.stale if comp else ())}:
                    last_stored[g] = s
            if steps == list(range(steps[0], steps[0] + len(steps))):  # a save every step:
                assert all(s - last_stored[g] < max_age for g in last_stored)  # type: ignore[operator]
        assert ucl.validate(d).ok


@SETTINGS
@given(runs(max_steps=9), st.sampled_from([0.05, 0.5, 10.0]), st.integers(2, 4), st.integers(1, 3),
       st.integers(2, 6), st.booleans())
def test_references_never_point_to_a_deleted_step(run, threshold, max_age, keep_last, full_every,
                                                   compact_one):
    steps, states = run
    by_step = dict(zip(steps, states, strict=True))
    prune = Prune(threshold=threshold, max_age=max_age)
    policy = DeltaPolicy(base="previous", full_every=full_every, prune=prune)
    with tempfile.TemporaryDirectory() as d:
        half = len(steps) // 2
        save_all(d, policy, steps[:half], states[:half], keep_last=keep_last)
        repo = ucl.Repository.open(d)
        if compact_one:  # a composite step compacted to full keeps its marker and its values
            for s in repo.steps():
                if repo.step_meta(s).composite is not None:
                    before, comp = load(d, s)
                    compact(d, s)
                    after, comp2 = load(d, s)
                    assert repo.step_meta(s).kind == "full" and comp2 == comp
                    assert all(bits(before[k]) == bits(after[k]) for k in before)
                    break
        save_all(d, policy, steps[half:], states[half:], keep_last=keep_last)
        kept = repo.steps()
        assert steps[-1] in kept
        for s in kept:
            meta = repo.step_meta(s)
            if meta.composite is not None and meta.kind == "delta":
                event("a kept composite step")
                for g in meta.composite.stale:
                    assert g.base_step in kept, (s, g)  # retention kept the referent
            got, comp = load(d, s)
            stale = comp.tensors() if comp is not None else {}
            for n in NAMES:
                src = stale[n].base_step if n in stale else s
                assert bits(got[n]) == bits(by_step[src][n])
        assert ucl.validate(d).ok


# -- readers: the approximate gate ---------------------------------------------------------------------
def _composite_repo(tmp_path: Path) -> tuple[str, list[dict[str, torch.Tensor]]]:
    states = [initial(0)]
    for _ in range(2):
        nxt = {k: v.clone() for k, v in states[-1].items()}
        nxt["model/head.w"] += 1.0  # a big change: stored
        nxt["model/layers.0.w"].mul_(1 + 1e-6)  # tiny: stale
        states.append(nxt)
    d = str(tmp_path / "r")
    save_all(d, DeltaPolicy(base="previous", prune=Prune(threshold=1e-3, max_age=8)), [1, 2, 3], states)
    return d, states


def test_open_refuses_a_composite_step_unless_approximate(tmp_path: Path) -> None:
    d, states = _composite_repo(tmp_path)
    with pytest.raises(ApproximateStepError) as e:
        ucl.open(d, 3)
    assert e.value.code == "unknown_extension"
    msg = str(e.value)
    assert "step 3" in msg and "composite step" in msg and "model/layers.0 (from step 1, 2 steps old)" in msg
    assert "approximate=True" in msg
    with pytest.raises(ApproximateStepError):
        ucl.load(d)
    with pytest.raises(ApproximateStepError):
        ucl.zarr_store(d, 3)
    with pytest.warns(ApproximateWarning, match=r"step 3 .* composite step: \d+ of \d+ groups hold older "
                      r"steps' values \(.*model/layers.0 \(from step 1, 2 steps old\).*loaded approximately"):
        ckpt = ucl.open(d, 3, approximate=True)
    with ckpt:
        assert not ckpt.exact
        assert ckpt.composite is not None
        g = {x.group: x for x in ckpt.composite.stale}["model/layers.0"]
        assert (g.base_step, g.age) == (1, 2) and 0 < g.update < 1e-3
        assert bits(ckpt["model/layers.0.w"][2:5]) == bits(states[0]["model/layers.0.w"][2:5])  # lazy slice
        assert bits(ckpt["model/head.w"][:]) == bits(states[2]["model/head.w"])
    with pytest.warns(ApproximateWarning):
        store = ucl.zarr_store(d, 3, approximate=True)
    import zarr

    root = zarr.open_group(store, mode="r")
    assert bits(torch.from_numpy(root["model/layers.0.w"][...])) == bits(states[0]["model/layers.0.w"])
    with CheckpointManager(d, delta=DeltaPolicy(base="previous", prune=Prune(threshold=1e-3))) as mgr:
        with pytest.raises(ApproximateStepError):
            mgr.restore()
        with pytest.warns(ApproximateWarning):
            got = mgr.restore(approximate=True)
    assert bits(got["model"]["layers.0.w"] if "model" in got and isinstance(got["model"], dict)
                else got["model/layers.0.w"]) == bits(states[0]["model/layers.0.w"])
    with ucl.open(d, 1) as full:  # steps without stale groups need nothing
        assert full.exact and full.composite is None


def test_cli_shows_a_composite_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ucl.tools.cli import main

    d, _ = _composite_repo(tmp_path)
    assert main(["ls", d]) == 0
    out = capsys.readouterr().out
    assert "approximate: 1/" in out and "groups stale, up to 2 steps old" in out
    assert main(["info", d, "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "APPROXIMATE (composite step" in out
    assert "stale model/layers.0: step 1's values, 2 steps old" in out
    assert main(["validate", d]) == 0


# -- the documents ------------------------------------------------------------------------------------
def test_stale_record_and_marker_round_trip_and_fail_closed(tmp_path: Path) -> None:
    r = DeltaRecord.from_dict({"mode": "stale", "base_step": 4, "age": 3})
    assert r.to_dict() == {"mode": "stale", "base_step": 4, "age": 3}
    for bad in ({"mode": "stale", "base_step": 4}, {"mode": "stale", "base_step": 4, "age": 0},
                {"mode": "stale", "base_step": 4, "age": 3, "encoding": "xor"},
                {"mode": "unchanged", "base_step": 4, "age": 3},
                {"mode": "stale", "base_step": 4, "age": 1.5}):
        with pytest.raises(SchemaError):
            DeltaRecord.from_dict(bad)
    d, _ = _composite_repo(tmp_path)
    repo = ucl.Repository.open(d)
    doc = repo.step_meta(3).to_dict()
    assert StepMeta.from_dict(doc, "step 3").composite == repo.step_meta(3).composite
    ext = next(e for e in doc["attributes"]["ucl"]["extensions"] if e["name"] == "ucl.composite")
    ext["configuration"]["stale"][0]["age"] += 1  # age disagrees with the step and base_step
    with pytest.raises(InconsistentMetadataError, match="age"):
        StepMeta.from_dict(doc, "step 3")
    doc = repo.step_meta(3).to_dict()
    doc["attributes"]["ucl"]["extensions"] = []  # stale arrays without the marker
    with pytest.raises(InconsistentMetadataError, match="no ucl.composite extension"):
        StepMeta.from_dict(doc, "step 3")
    doc = repo.step_meta(3).to_dict()
    ext = next(e for e in doc["attributes"]["ucl"]["extensions"] if e["name"] == "ucl.composite")
    ext["must_understand"] = False
    with pytest.raises(SchemaError):
        StepMeta.from_dict(doc, "step 3")


def test_policy_arguments_are_checked() -> None:
    for kw in ({"threshold": -1}, {"threshold": float("nan")}, {"top_k": 0}, {"max_age": 0}, {"groups": "x"},
               {"groups": ("(",)}, {"lossless": 1}):
        with pytest.raises(InvalidArgumentError):
            Prune(**kw)
    with pytest.raises(InvalidArgumentError, match="base='previous'"):
        DeltaPolicy(prune=Prune())
    with pytest.raises(InvalidArgumentError, match="gradients"):
        DeltaPolicy(base="previous", gradients=True, prune=Prune())
    assert Prune().group_of("model/layers.3.attention.qkv.weight") == "model/layers.3"
    assert Prune().group_of("model/h.11.mlp.w") == "model/h.11"
    assert Prune().group_of("model/lm_head.weight") == "model/lm_head"
    assert Prune(groups=(r"^model/(\w+)",)).group_of("model/layers.3.w") == "layers"


def test_optimizer_state_joins_its_parameters_group(tmp_path: Path) -> None:
    from ucl.testing.gpt import SyntheticData, full_state, make_model_and_optimizer, train_step

    model, opt = make_model_and_optimizer("tiny", seed=0)
    data = SyntheticData(model.config, seed=0)
    prune = Prune(threshold=0.045, max_age=3)
    with CheckpointManager(tmp_path / "r", delta=DeltaPolicy(base="previous", prune=prune)) as mgr:
        for step in range(1, 5):
            train_step(model, opt, data.batch(step))
            mgr.save(step, full_state(model, opt), optimizer=opt).result()
    seen = False
    for s in (2, 3, 4):
        comp = ucl.Repository.open(tmp_path / "r").step_meta(s).composite
        for g in comp.stale if comp is not None else ():
            seen = True
            params = [t for t in g.tensors if t.startswith("model/")]
            states = [t for t in g.tensors if t.startswith("optim/state/")]
            assert params and states and all(t.startswith(g.group + ".") for t in params)
            assert len(states) == 3 * len(params)  # step, exp_avg, exp_avg_sq of each parameter
    assert seen
    with pytest.raises(InvalidArgumentError, match=r"composite steps .* without a layout"):
        CheckpointManager(tmp_path / "x", delta=DeltaPolicy(base="previous", prune=prune), layout="")


def test_lossless_false_writes_the_changed_groups_full(tmp_path: Path) -> None:
    d, states = str(tmp_path / "r"), [initial(1)]
    nxt = {k: v.clone() for k, v in states[0].items()}
    nxt["model/head.w"] += 1.0
    states.append(nxt)
    save_all(d, DeltaPolicy(base="previous", prune=Prune(threshold=1e-3, lossless=False)), [1, 2], states)
    meta = ucl.Repository.open(d).step_meta(2)
    assert meta.arrays["model/head.w"].delta is None  # stored full inside the delta step
    assert meta.arrays["model/layers.0.w"].delta["mode"] == "unchanged"  # bit-identical: no data either way
    got = ucl.load(d, 2, flat=True)
    assert all(bits(got[k]) == bits(states[1][k]) for k in states[1])


def test_documents_match_the_schema(tmp_path: Path) -> None:
    import json

    import jsonschema

    schema = json.loads((Path(__file__).parents[2] / "spec" / "schemas" / "delta.schema.json").read_text())

    def check(defn: str, doc: object) -> None:
        jsonschema.Draft202012Validator({**schema, "$ref": f"#/$defs/{defn}"}).validate(doc)

    for ex in schema["$defs"]["composite"]["examples"]:
        assert Composite.from_extension(ex).to_extension() == ex
    d, _ = _composite_repo(tmp_path)
    meta = ucl.Repository.open(d).step_meta(3)
    check("composite", meta.composite.to_extension())
    for a in meta.arrays.values():
        if a.delta is not None:
            check("record", a.delta)
            assert DeltaRecord.from_dict(a.delta).to_dict() == a.delta
    bad = meta.composite.to_extension()
    bad["configuration"]["stale"][0]["age"] = 0
    with pytest.raises(jsonschema.ValidationError):
        check("composite", bad)
    with pytest.raises(SchemaError):
        Composite.from_extension(bad)
