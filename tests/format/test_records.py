"""Delta metadata (spec/delta.md §3, §8): dataclasses <-> JSON, checked against schemas/delta.schema.json.

Every example in the schema validates; every record round-trips; bad records fail closed in both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucl.errors import FormatError, SchemaError
from ucl.format.records import DeltaRecord, GradientRecords, OptimizerFingerprint, parse_codec

SCHEMA = json.loads((Path(__file__).parents[2] / "spec" / "schemas" / "delta.schema.json").read_text())


def validator(defn: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**SCHEMA, "$ref": f"#/$defs/{defn}"})


def examples(node: Any) -> list[tuple[str, Any]]:
    """Every (path, example) of every property in the schema."""
    out: list[tuple[str, Any]] = []

    def walk(n: Any, path: str) -> None:
        if isinstance(n, dict):
            for ex in n.get("examples", []):
                out.append((path, ex))
            for k, v in n.items():
                if k != "examples":
                    walk(v, f"{path}/{k}")
        elif isinstance(n, list):
            for i, v in enumerate(n):
                walk(v, f"{path}/{i}")

    walk(node, "")
    return out


def test_schema_is_valid_and_every_example_validates() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    found = examples(SCHEMA)
    assert len(found) > 20
    for path, ex in found:
        sub = SCHEMA
        for part in path.strip("/").split("/"):
            sub = sub[int(part)] if isinstance(sub, list) else sub[part]
        jsonschema.Draft202012Validator(
            {**SCHEMA, **{k: v for k, v in sub.items() if k != "$defs"}}
        ).validate(ex)


def test_every_property_has_a_description_or_examples() -> None:
    def walk(n: Any, path: str) -> None:
        if isinstance(n, dict):
            for name, p in n.get("properties", {}).items():
                assert "description" in p or "examples" in p or "$ref" in p, f"{path}/{name}"
            for k, v in n.items():
                walk(v, f"{path}/{k}")
        elif isinstance(n, list):
            for v in n:
                walk(v, path)

    walk(SCHEMA, "")


records = st.one_of(
    st.builds(DeltaRecord, mode=st.just("unchanged"), base_step=st.integers(0, 2**63 - 1)),
    st.builds(
        DeltaRecord,
        mode=st.just("chunked"),
        base_step=st.integers(0, 2**63 - 1),
        encoding=st.sampled_from(["xor", "sub"]),
    ),
)


@given(records)
def test_record_round_trips_and_matches_the_schema(r: DeltaRecord) -> None:
    d = r.to_dict()
    validator("record").validate(d)
    assert DeltaRecord.from_dict(json.loads(json.dumps(d))) == r
    if r.mode == "chunked":
        validator("codec").validate(r.codec())
        parse_codec(r.codec(), r)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"mode": "chunked", "base_step": 3}, "needs encoding"),
        ({"mode": "chunked", "base_step": 3, "encoding": "add"}, "needs encoding"),
        ({"mode": "unchanged", "base_step": 3, "encoding": "xor"}, "has no encoding"),
        ({"mode": "copy", "base_step": 3}, "mode must be one of"),
        ({"mode": "unchanged"}, r"missing \['base_step'\]"),
        ({"mode": "unchanged", "base_step": -1}, "base_step: expected an integer"),
        ({"mode": "unchanged", "base_step": True}, "base_step: expected an integer"),
        ({"mode": "unchanged", "base_step": 2, "parent": 1}, r"unknown fields \['parent'\]"),
        ([1, 2], "expected an object"),
    ],
)
def test_bad_records_fail_closed(bad: Any, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        DeltaRecord.from_dict(bad)
    assert not validator("record").is_valid(bad)


def test_codec_must_agree_with_the_record() -> None:
    r = DeltaRecord("chunked", 7, "sub")
    parse_codec(
        {"name": "ucl.delta", "configuration": {"encoding": "sub", "base_step": 7}, "must_understand": True},
        r,
    )
    with pytest.raises(FormatError, match="disagrees"):
        parse_codec({"name": "ucl.delta", "configuration": {"encoding": "xor", "base_step": 7}}, r)
    with pytest.raises(SchemaError, match="must_understand cannot be false"):
        parse_codec(
            {
                "name": "ucl.delta",
                "configuration": {"encoding": "sub", "base_step": 7},
                "must_understand": False,
            },
            r,
        )
    with pytest.raises(SchemaError, match="unknown fields"):
        parse_codec(
            {"name": "ucl.delta", "configuration": {"encoding": "sub", "base_step": 7, "level": 3}}, r
        )
    with pytest.raises(FormatError, match="has no codec"):
        DeltaRecord("unchanged", 7).codec()


def test_gradient_records_extension_round_trips() -> None:
    fp = OptimizerFingerprint(
        torch_version="2.13.0",
        optimizer="torch.optim.AdamW",
        options={"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        implementation="foreach",
        dtype="float32",
        device="cpu",
    )
    rec = GradientRecords(base_step=41, fingerprint=fp, parameters=("model/w", "model/b"),
                          param_groups=({"lr": 3e-4, "betas": [0.9, 0.999]},))
    ext = rec.to_extension()
    validator("gradient_records").validate(ext)
    assert GradientRecords.from_extension(json.loads(json.dumps(ext))) == rec
    for key, value, match in (("parameters", ["a", "a"], "twice"), ("param_groups", [], "non-empty"),
                              ("param_groups", [{"params": [0]}], "without 'params'"), ("gradients", "", "non-empty")):
        bad = json.loads(json.dumps(ext))
        bad["configuration"][key] = value
        with pytest.raises(SchemaError, match=match):
            GradientRecords.from_extension(bad)
        assert not validator("gradient_records").is_valid(bad)
    bad = json.loads(json.dumps(ext))
    bad["configuration"]["fingerprint"]["implementation"] = "cuda-graph"
    with pytest.raises(SchemaError, match="implementation must be"):
        GradientRecords.from_extension(bad)
    assert not validator("gradient_records").is_valid(bad)
    del bad["configuration"]["fingerprint"]["device"]
    with pytest.raises(SchemaError, match=r"missing \['device'\]"):
        GradientRecords.from_extension(bad)
