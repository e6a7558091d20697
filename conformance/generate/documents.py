"""``cases/documents.json``: the boundaries spec/core.md v1.1 made exact.

Each rule is tested on both sides of its boundary: the JSON profile (§3.4: depth 128 and 129, integer
tokens `4.0` and `4e0`, integers at 2^64 - 1 and 2^64, -2^63 and -2^63 - 1, canonical JSON is what a
record's checksum covers, not its bytes), the steps group document (§3.2), intermediate group
documents (§3.3), the digest's index order (§7), tree depth 32 and 33 (§5.3), a dimension of 2^62 - 1
and 2^62 (§6), slices (§10.1), and which commit records list a step (§7 item 6).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import torch

from ucl.plan.save import array_for

from .fixture import Fx, crc, json_depth, random_tensor, tiny, tiny_state
from .suite import Cases, sha

S_DEPTH = "core.md §3.4 item 2"
S_INTEGERS = "core.md §3.4 item 3"
S_CANONICAL = "core.md §3.4 item 7"


def _nested(levels: int) -> Any:
    node: Any = 0
    for _ in range(levels):
        node = [node]
    return node


def build(root: Path, cases: Cases) -> None:
    json_profile(root, cases)
    documents(root, cases)
    bounds(root, cases)
    precedence(root, cases)


def json_profile(root: Path, cases: Cases) -> None:
    # depth: the step document is depth 1, its attributes 2, so k nested lists in an attribute reach 2 + k
    for depth, ok in ((128, True), (129, False)):
        fx = f"hostile/step_document_depth_{depth}"
        f, st = tiny(root, fx)
        f.edit_step_doc(1, lambda d, k=depth - 2: d["attributes"].__setitem__("user", _nested(k)))
        assert json_depth(f.read_json("steps/1/zarr.json")) == depth
        if ok:
            cases.valid(f"a step document exactly {depth} levels deep is valid", S_DEPTH, fx, "validate")
            cases.reads(S_DEPTH, fx, {"w": st["w"]}, what=lambda _, d=depth: f" next to a {d}-level value")
        else:
            cases.invalid(f"a step document {depth} levels deep, one past the limit", S_DEPTH, fx,
                          "limit_exceeded")
            cases.error(f"a step document {depth} levels deep does not open", S_DEPTH, fx, "open",
                        "limit_exceeded", {"step": 1})

    # integer tokens where the schema says integer
    for fx, token, what in (
        ("hostile/shape_written_4e0", b"4e0", "an exponent"),
        ("hostile/shape_written_4_0", b"4.0", "a fraction"),
    ):
        f, st = tiny(root, fx)
        _set_first_dim(f, token)
        cases.invalid(f"a dimension written with {what} ({token.decode()}) is not an integer", S_INTEGERS, fx,
                      "schema_violation")
        cases.error(f"a step whose dimension is written {token.decode()} does not open", S_INTEGERS, fx, "open",
                    "schema_violation", {"step": 1})

    # every integer token within [-2^63, 2^64 - 1], wherever it is
    for fx, value, ok in (
        ("hostile/integer_2_pow_64_minus_1", 2**64 - 1, True),
        ("hostile/integer_2_pow_64", 2**64, False),
        ("hostile/integer_minus_2_pow_63", -(2**63), True),
        ("hostile/integer_minus_2_pow_63_minus_1", -(2**63) - 1, False),
    ):
        f, st = tiny(root, fx)
        f.edit_step_doc(1, lambda d, v=value: d["attributes"].__setitem__("user", {"n": v}))
        if ok:
            cases.valid(f"an integer {value} in a user attribute is within 64 bits", S_INTEGERS, fx, "validate")
            cases.reads(S_INTEGERS, fx, {"w": st["w"]}, what=lambda _, v=value: f" next to the integer {v}")
        else:
            cases.invalid(f"an integer {value} in a user attribute is beyond 64 bits", S_INTEGERS, fx,
                          "schema_violation")
            cases.error(f"a step document holding the integer {value} does not open", S_INTEGERS, fx, "open",
                        "schema_violation", {"step": 1})

    # the checksum covers the canonical form, not the bytes: members reordered, other whitespace
    fx = "valid/commit_record_reformatted"
    f, st = tiny(root, fx)
    doc = f.commit_doc(1)
    body = dict(reversed(list(doc.items())))
    f.put("commits/1.json", json.dumps(body, indent=4).encode() + b"\n\n")
    cases.valid("a commit record written with other member order and whitespace verifies", S_CANONICAL, fx,
                "validate")
    cases.valid("and its step is listed", "core.md §7 item 6", fx, "list_steps", steps=[1])
    cases.reads(S_CANONICAL, fx, st)


    # a lone surrogate has no UTF-8 encoding, so a record holding one has no canonical form (§3.4 item 7)
    fx = "hostile/lone_surrogate_in_commit_record"
    f, st = tiny(root, fx)
    doc = f.commit_doc(1)
    doc["time"] = "2026-12-01T00:00:00.000000Z\ud800"
    body = {k: v for k, v in doc.items() if k != "checksum"}  # sealed as if the surrogate were a character
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    doc["checksum"] = crc(canon.encode("utf-8", "surrogatepass"))
    f.put("commits/1.json", json.dumps(doc).encode())  # ensure_ascii: written as the escape \ud800
    cases.invalid("a commit record whose time holds a lone surrogate (\\ud800)", S_CANONICAL, fx,
                  "corrupt_commit_record")
    cases.error("its step does not open", S_CANONICAL, fx, "open", "corrupt_commit_record", {"step": 1})
    cases.valid("and it is not listed", "core.md §7 item 6", fx, "list_steps", steps=[])


def documents(root: Path, cases: Cases) -> None:
    fx = "invalid/metadata/steps_group_document_missing"
    f, st = tiny(root, fx)
    f.p("steps/zarr.json").unlink()
    cases.invalid("steps/zarr.json is missing", "core.md §3.2", fx, "schema_violation")
    cases.valid("readers do not need steps/zarr.json", "core.md §3.2", fx, "list_steps", steps=[1])
    cases.reads("core.md §3.2", fx, st, what=lambda _: " without steps/zarr.json")

    fx = "invalid/metadata/steps_group_document_not_a_group"
    f, st = tiny(root, fx)
    f.put("steps/zarr.json", b'{"zarr_format": 3, "node_type": "array", "attributes": {}}')
    cases.invalid("steps/zarr.json is not a group document", "core.md §3.2", fx, "schema_violation")

    # an intermediate group document that the record does not list needs no file (§3.3)
    fx = "valid/group_documents_unlisted"
    f = Fx(root, fx)
    state = {"model": {"layer": {"w": random_tensor((3, 2), torch.float32, 1201)}}}
    f.save(state, 1)
    for rel in ("model/layer/zarr.json", "model/zarr.json"):
        f.p(f"steps/1/{rel}").unlink()
        f.edit_commit(1, lambda d, r=rel: d["files"].pop(r))
    cases.valid("intermediate group documents neither listed nor present: valid", "core.md §3.3", fx,
                "validate")
    cases.reads("core.md §3.3", fx, {"model/layer/w": state["model"]["layer"]["w"]})

    # the digest follows index order, not file order (§7)
    fx = "valid/shard_chunks_in_reverse_file_order"
    f = Fx(root, fx)
    w = random_tensor((4, 3), torch.float32, 1203)
    f.write(1, [(dataclasses.replace(array_for("w", w), inner_chunk_shape=(1, 3)), w)])
    _reverse_chunks(f, w)
    cases.valid("a shard whose inner chunks lie in the file in reverse index order", "core.md §7", fx,
                "validate")
    cases.reads("core.md §7", fx, {"w": w}, boxes={"w": [[[1, 3], [0, 3]]]})

    # documents as ucl's writers of 2026-11 wrote them: whitespace after `:` and `,`, indented, and no
    # dimension_names (which writers of today write, §6 item 6: MAY). Both are valid: readers parse JSON,
    # not bytes (§3.4 item 6), and never need dimension_names
    fx = "valid/documents_spaced_without_dimension_names"
    f, st = tiny(root, fx, seed=1204)
    docs = sorted(str(p.relative_to(f.path)) for p in f.path.rglob("zarr.json"))
    for rel in docs:
        d = f.read_json(rel)
        d.pop("dimension_names", None)
        for entry in d.get("consolidated_metadata", {}).get("metadata", {}).values():
            entry.pop("dimension_names", None)
        f.put(rel, json.dumps(d, indent=1).encode())
    f.reseal(1, *(rel.split("/", 2)[2] for rel in docs if rel.startswith("steps/1/")))
    assert b'": ' in f.read("steps/1/w/zarr.json") and b"dimension_names" not in f.read("steps/1/zarr.json")
    cases.valid("documents written with whitespace and without dimension_names are valid",
                "core.md §6 item 6", fx, "validate")
    cases.valid("and the step opens", "core.md §3.4 item 6", fx, "open", step=1, keys=sorted(st))
    cases.reads("core.md §6 item 6", fx, st)

    # tree depth: 32 is the limit (a tensor at depth 32 has a 32-segment name), 33 is past it
    fx = "valid/tree_depth_32"
    f = Fx(root, fx)
    t = random_tensor((2,), torch.float32, 1202)
    deep: Any = t
    for i in range(32):
        deep = {f"k{31 - i}": deep}
    f.save(deep, 1)
    name = "/".join(f"k{i}" for i in range(32))
    cases.valid("a structure tree of depth 32 (a 32-segment name)", "core.md §5.3 item 2", fx, "validate")
    cases.reads("core.md §5.3 item 2", fx, {name: t})

    # records the reader cannot verify do not list their step (§7 item 6)
    fx = "invalid/commit/newest_record_of_newer_version"
    f = Fx(root, fx)
    f.save(tiny_state(1210), 1)
    f.save(tiny_state(1211), 2)
    f.edit_commit(2, lambda d: d.__setitem__("ucl_commit", 3))
    cases.invalid("the newest record is of a newer version", "core.md §7 item 5", fx, "unsupported_version")
    cases.valid("a record of a newer version does not list its step", "core.md §7 item 6", fx, "list_steps",
                steps=[1])
    cases.valid("the latest step is the greatest listed", "core.md §7 item 6", fx, "open", step=1)


def bounds(root: Path, cases: Cases) -> None:
    # dimensions: 2^62 - 1 passes the schema (and then misses its shards), 2^62 does not
    for dim, code, section in ((2**62 - 1, "missing_shard", "core.md §8 item 5"),
                               (2**62, "schema_violation", "core.md §6 item 1")):
        fx = f"hostile/dimension_{'2_pow_62' if dim == 2**62 else '2_pow_62_minus_1'}"
        f = Fx(root, fx)
        f.save({"b": torch.zeros(4, dtype=torch.bool)}, 1)

        def big(a: dict[str, Any], d: int = dim) -> None:
            a["shape"] = [d]

        f.edit_array(1, "b", big)
        cases.invalid(f"a bool tensor of {dim} elements, one shard on disk", section, fx, code)

    # slices the request cannot have
    fx = "valid/shapes"
    for box, what in (([[3, 2], [0, 3], [0, 5]], "whose start is after its stop"),
                      ([[-1, 1], [0, 3], [0, 5]], "with a negative start")):
        cases.error(f"a slice {what} is refused", "core.md §10.1", fx, "read", "invalid_argument",
                    {"tensor": "odd_7x3x5", "slice": box})
    cases.valid("an empty slice at the end of a dimension", "core.md §10.1", fx, "read",
                {"tensor": "odd_7x3x5", "slice": [[7, 7], [0, 3], [0, 5]]}, shape=[0, 3, 5],
                data_sha256=sha(torch.zeros(0)))


def precedence(root: Path, cases: Cases) -> None:
    """One document with two defects: the code of the check §10.2 runs first."""
    fx = "invalid/metadata/newer_version_and_schema_violation"
    f, st = tiny(root, fx)

    def newer(d: dict[str, Any]) -> None:
        d["attributes"]["ucl"]["format_version"] = 4
        del d["attributes"]["ucl"]["tree"]

    f.edit_step_doc(1, newer)
    cases.invalid("a step document of version 4 without a tree: the version is checked first",
                  "core.md §10.2 item 3", fx, "unsupported_version")
    cases.error("and it does not open, for the same reason", "core.md §10.2 item 3", fx, "open",
                "unsupported_version", {"step": 1})

    fx = "invalid/metadata/bad_dtype_and_schema_violation"
    f, st = tiny(root, fx)

    def dtype_and_grid(a: dict[str, Any]) -> None:
        a["data_type"] = "float"
        del a["chunk_grid"]

    f.edit_array(1, "w", dtype_and_grid)
    cases.invalid("an unknown data type in an array document that also lacks its chunk grid",
                  "core.md §10.2 item 1", fx, "unsupported_dtype")

    fx = "invalid/commit/newer_version_and_unknown_field"
    f, st = tiny(root, fx)

    def newer_record(d: dict[str, Any]) -> None:
        d["ucl_commit"] = 3
        d["shards_v2"] = {}

    f.edit_commit(1, newer_record)
    cases.invalid("a commit record of version 3 with a field no version knows",
                  "core.md §7 item 5", fx, "unsupported_version")


def _set_first_dim(f: Fx, token: bytes) -> None:
    """Write the first dimension of w's shape as ``token`` in both documents, resealed."""
    for rel in ("steps/1/zarr.json", "steps/1/w/zarr.json"):
        data = f.read(rel)
        doc = json.loads(data)
        node = doc["consolidated_metadata"]["metadata"]["w"] if rel == "steps/1/zarr.json" else doc
        node["shape"][0] = "@@DIM@@"
        f.put(rel, json.dumps(doc).replace('"@@DIM@@"', token.decode()).encode())
        f.reseal(1, rel.split("/", 2)[2])


def _reverse_chunks(f: Fx, w: torch.Tensor) -> None:
    """Rewrite w's only shard (4x3 float32, inner chunks of rows) with the chunks in reverse file order."""
    doc = f.read_json("steps/1/w/zarr.json")
    inner = doc["codecs"][0]["configuration"]["chunk_shape"]
    rows = inner[0]
    raw = [w[i : i + rows].contiguous().view(torch.uint8).numpy().tobytes() for i in range(0, 4, rows)]
    assert len(raw) > 1, "the fixture needs a shard of several inner chunks"
    data, entries = b"", [None] * len(raw)
    for i in reversed(range(len(raw))):
        entries[i] = (len(data), len(raw[i]) + 4)
        data += raw[i] + struct.pack("<I", crc(raw[i]))
    index = b"".join(struct.pack("<QQ", o, n) for o, n in entries)  # type: ignore[misc]
    f.put("steps/1/w/c/0/0", data + index + struct.pack("<I", crc(index)))
    f.reseal(1, "w/c/0/0")
