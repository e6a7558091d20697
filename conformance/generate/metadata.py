"""``cases/metadata.json``: the repository and step documents, one lie each, resealed.

Covers core.md §3.1, §4, §5.1, §5.3, §6 and §9: unknown required extensions and codecs, newer format
versions, data types outside the table, chunk grids that do not fit, codecs and layouts UCL v1 does not
allow, step documents that are not JSON, array documents that disagree with their consolidated copy,
malformed and too deep structure trees. Every size and checksum covering the edit is recomputed, so only
the lie is left to catch. The lies about gradient records are in gradient_records.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ucl.format import metadata

from .fixture import Fx, random_tensor, tiny
from .suite import S_ARRAYS, S_DTYPES, S_EXT, S_REPO_DOC, S_STEP_DOC, S_TREE, Cases, sha


def deep_tree(d: dict[str, Any]) -> None:
    """A structure tree of 40 nested lists around tensor 'w' (the limit is 32)."""
    node: dict[str, Any] = {"t": "tensor", "name": "w"}
    for _ in range(40):
        node = {"t": "list", "items": [node]}
    d["attributes"]["ucl"]["tree"] = node


def build(root: Path, cases: Cases) -> None:
    fx = "invalid/metadata/unknown_must_understand_extension"
    f, st = tiny(root, fx)
    f.edit_step_doc(
        1,
        lambda d: d["attributes"]["ucl"].__setitem__(
            "extensions", [{"name": "example.required_feature", "configuration": {}}]
        ),
    )
    cases.invalid(
        "a step requiring an unknown extension (must_understand absent)",
        S_EXT,
        fx,
        "unknown_extension",
    )
    cases.error(
        "a step requiring an unknown extension does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
        {"step": 1},
    )

    fx = "invalid/metadata/unknown_must_understand_true_extension"
    f, st = tiny(root, fx)
    f.edit_step_doc(
        1,
        lambda d: d["attributes"]["ucl"].__setitem__(
            "extensions", [{"name": "example.required_feature", "configuration": {}, "must_understand": True}]
        ),
    )
    cases.invalid(
        "a step requiring an unknown extension (must_understand true)",
        S_EXT,
        fx,
        "unknown_extension",
    )

    fx = "invalid/metadata/unknown_repository_extension"
    f, st = tiny(root, fx)
    f.edit_json(
        "zarr.json",
        lambda d: d["attributes"]["ucl"].__setitem__(
            "extensions", [{"name": "example.required_feature", "must_understand": True}]
        ),
    )
    cases.invalid("a repository requiring an unknown extension", S_EXT, fx, "unknown_extension")
    cases.error(
        "a repository requiring an unknown extension does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
    )
    cases.error("nor does it list its steps", S_EXT, fx, "list_steps", "unknown_extension")

    fx = "invalid/metadata/unknown_codec"
    f, st = tiny(root, fx)
    f.edit_array(
        1,
        "w",
        lambda d: d["codecs"][0]["configuration"]["codecs"].insert(
            1, {"name": "gzip", "configuration": {"level": 5}}
        ),
    )
    cases.invalid("an inner codec that is not part of UCL v1", S_EXT, fx, "unknown_extension")
    cases.error(
        "a step with an unknown codec does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
        {"step": 1},
    )

    fx = "invalid/metadata/unsupported_version"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("format_version", 4))
    cases.invalid("a step document of format version 4", S_EXT, fx, "unsupported_version")
    cases.error(
        "a step of a newer format version does not open",
        S_EXT,
        fx,
        "open",
        "unsupported_version",
        {"step": 1},
    )

    fx = "invalid/metadata/unsupported_repository_version"
    f, st = tiny(root, fx)
    f.edit_json("zarr.json", lambda d: d["attributes"]["ucl"].__setitem__("format_version", 99))
    cases.invalid("a repository of format version 99", S_REPO_DOC, fx, "unsupported_version")
    cases.error(
        "a repository of a newer format version does not open",
        S_REPO_DOC,
        fx,
        "open",
        "unsupported_version",
    )

    fx = "invalid/metadata/missing_repository_document"
    f, st = tiny(root, fx)
    f.p("zarr.json").unlink()
    cases.invalid("a directory without zarr.json is not a repository", S_REPO_DOC, fx, "not_found")
    cases.error("opening a directory that is not a repository", S_REPO_DOC, fx, "open", "not_found")

    fx = "invalid/metadata/repository_document_not_ucl"
    f, st = tiny(root, fx)
    f.put("zarr.json", metadata.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    cases.invalid("a plain Zarr group without attributes.ucl", S_REPO_DOC, fx, "schema_violation")
    cases.error("opening a plain Zarr group", S_REPO_DOC, fx, "open", "schema_violation")

    fx = "invalid/metadata/bad_dtype"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("data_type", "float128"))
    cases.invalid("a data type outside the spec's table", S_DTYPES, fx, "unsupported_dtype")
    cases.error(
        "a step with an unknown data type does not open",
        S_DTYPES,
        fx,
        "open",
        "unsupported_dtype",
        {"step": 1},
    )

    fx = "invalid/metadata/bad_dtype_zarr_v2_spelling"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("data_type", "<f4"))
    cases.invalid("a zarr v2 dtype string is not a UCL data type", S_DTYPES, fx, "unsupported_dtype")

    fx = "invalid/metadata/inner_chunk_not_dividing"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"].__setitem__("chunk_shape", [3, 3]))
    cases.invalid(
        "an inner chunk shape that does not divide the chunk shape",
        S_ARRAYS,
        fx,
        "inconsistent_metadata",
    )
    cases.error(
        "a step whose inner chunks do not divide its chunks does not open",
        S_ARRAYS,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/metadata/rank_mismatch"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [4, 3, 1]))
    cases.invalid("a chunk shape of another rank than the shape", S_ARRAYS, fx, "inconsistent_metadata")

    fx = "invalid/metadata/array_doc_differs_from_consolidated"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [4, 2]), consolidated=False)
    cases.invalid(
        "an array document that differs from the step's consolidated copy",
        S_STEP_DOC,
        fx,
        "inconsistent_metadata",
    )
    cases.add(
        "readers use the consolidated copy: the tensor reads as committed, or fails",
        S_STEP_DOC,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["inconsistent_metadata"],
    )

    fx = "invalid/metadata/array_not_in_consolidated"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, lambda d: d["consolidated_metadata"]["metadata"].pop("s"))
    cases.invalid(
        "the tree names a tensor that consolidated metadata does not list",
        S_TREE,
        fx,
        "inconsistent_metadata",
    )
    cases.error(
        "a step whose tree names a missing array does not open",
        S_TREE,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/metadata/big_endian_bytes_codec"
    f, st = tiny(root, fx)
    f.edit_array(
        1,
        "w",
        lambda d: d["codecs"][0]["configuration"]["codecs"][0]["configuration"].__setitem__("endian", "big"),
    )
    cases.invalid("inner bytes codec big-endian", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/no_inner_crc32c"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"]["codecs"].pop())
    cases.invalid("inner codecs without crc32c", S_ARRAYS, fx, "schema_violation")
    cases.error(
        "a step whose chunks carry no checksum does not open",
        S_ARRAYS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/no_index_crc32c"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"]["index_codecs"].pop())
    cases.invalid("index codecs without crc32c", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/index_at_start"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["codecs"][0]["configuration"].__setitem__("index_location", "start"))
    cases.invalid("shard index at the start", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/storage_transformer"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("storage_transformers", [{"name": "x"}]))
    cases.invalid("a storage transformer", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/chunk_key_encoding_v2"
    f, st = tiny(root, fx)
    f.edit_array(
        1,
        "w",
        lambda d: d.__setitem__("chunk_key_encoding", {"name": "v2", "configuration": {"separator": "."}}),
    )
    cases.invalid("v2 chunk key encoding", S_ARRAYS, fx, "schema_violation")

    fx = "invalid/metadata/zstd_bad_configuration"
    f = Fx(root, fx)
    f.save({"w": random_tensor((8, 8), torch.float32, 1200)}, 1, compression="zstd")
    f.edit_array(
        1,
        "w",
        lambda d: d["codecs"][0]["configuration"]["codecs"][1]["configuration"].__setitem__("level", "fast"),
    )
    cases.invalid("a zstd codec whose level is not an integer", S_ARRAYS, fx, "schema_violation")
    cases.error(
        "a step with a malformed zstd configuration does not open",
        S_ARRAYS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/step_doc_not_json"
    f, st = tiny(root, fx)
    f.put("steps/1/zarr.json", b"{this is not json")
    f.reseal(1, "zarr.json")
    cases.invalid("a step document that is not JSON", S_STEP_DOC, fx, "schema_violation")
    cases.error(
        "a step whose document is not JSON does not open",
        S_STEP_DOC,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/step_doc_missing_tree"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].pop("tree"))
    cases.invalid("a step document without its structure tree", S_STEP_DOC, fx, "schema_violation")

    fx = "invalid/metadata/step_doc_wrong_step"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("step", 2))
    cases.invalid("steps/1/zarr.json says it is step 2", S_STEP_DOC, fx, "inconsistent_metadata")
    cases.error(
        "a step document of another step does not open",
        S_STEP_DOC,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/metadata/malformed_tree"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("tree", {"t": "dict", "items": 5}))
    cases.invalid("a structure tree whose dict items are not a list", S_TREE, fx, "schema_violation")
    cases.error(
        "a step with a malformed tree does not open",
        S_TREE,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "invalid/metadata/tree_too_deep"
    f, st = tiny(root, fx)

    f.edit_step_doc(1, deep_tree)
    cases.invalid("a structure tree deeper than 32", S_TREE, fx, "limit_exceeded")
    cases.error(
        "a step with a too deep tree does not open",
        S_TREE,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )
