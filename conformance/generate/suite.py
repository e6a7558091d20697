"""The cases: what each case file says an implementation must do with a fixture.

``Suite`` collects the cases of every case file (``cases/<feature>.json``) in declaration order; ``Cases``
declares those of one file, with the shorthands the feature modules use (a valid result, an invalid
verdict, an error, one read case per tensor). Expected data is the sha256 of the little-endian bytes of
the *original* tensors, never of what a reader returned. The spec sections cases cite are named here:
a module names the section of its feature, and :func:`cite` narrows it to the section, or numbered
item, that states the expected code's condition (spec/core.md §10.1 names it for every code), so that
each case's verdict follows from its ``spec`` citation.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import Any

import torch

# spec sections (spec/core.md)
S_LAYOUT = "core.md §3 Repository layout"
S_REPO_DOC = "core.md §3.1 Repository document"
S_DTYPES = "core.md §4 Data types"
S_STEP_DOC = "core.md §5.1 Step group document"
S_NAMES = "core.md §5.2 Tensor names"
S_TREE = "core.md §5.3 Structure tree"
S_ARRAYS = "core.md §6 Arrays"
S_SHARD = "core.md §6.1 Shard encoding"
S_COMMIT = "core.md §7 Commit protocol"
S_INTEGRITY = "core.md §8 item 1"
S_LIMITS = "core.md §8 item 4"
S_EXT = "core.md §9 Extensions and versioning"
S_JSON = "core.md §3.4 Documents: the JSON profile"
S_ZSTD = "core.md §6.2 The zstd codec"

# Where each code's condition is stated (spec/core.md §10.1), for cases whose module names a core.md
# section: the default per code, and the fixtures whose defect is stated elsewhere.
_BY_CODE = {
    "not_found": "core.md §7 item 6",
    "not_committed": "core.md §7 item 6",
    "tensor_not_found": "core.md §5.3 item 3",
    "schema_violation": "core.md §3.4 item 4",
    "unsupported_version": "core.md §9 item 1",
    "unknown_extension": "core.md §9 item 2",
    "invalid_name": "core.md §5.2 item 3",
    "unsupported_dtype": "core.md §6 item 7",
    "limit_exceeded": "core.md §3.4 item 2",
    "inconsistent_metadata": "core.md §5.1",
    "checksum_mismatch": "core.md §8 item 1",
    "missing_shard": "core.md §8 item 5",
    "size_mismatch": "core.md §8 item 1",
    "corrupt_shard_index": "core.md §6.1",
    "corrupt_commit_record": "core.md §7 item 5",
    "integrity_error": "core.md §6.2 item 3",
    "invalid_argument": "core.md §10.1",
    "not_a_file": "core.md §3 item 3",
}
_BY_FIXTURE = {
    # schema_violation
    "hostile/shape_2_pow_63": "core.md §6 item 1",
    "hostile/negative_shape": "core.md §6 item 1",
    "hostile/float_shape": "core.md §3.4 item 3",
    "hostile/huge_integer_literal": "core.md §3.4 item 3",
    "invalid/metadata/repository_document_not_ucl": "core.md §3.1",
    "invalid/metadata/big_endian_bytes_codec": "core.md §6 item 4",
    "invalid/metadata/no_inner_crc32c": "core.md §6 item 4",
    "invalid/metadata/no_index_crc32c": "core.md §6 item 4",
    "invalid/metadata/index_at_start": "core.md §6 item 4",
    "invalid/metadata/storage_transformer": "core.md §6 item 6",
    "invalid/metadata/chunk_key_encoding_v2": "core.md §6 item 3",
    "invalid/metadata/zstd_bad_configuration": "core.md §6.2",
    "invalid/metadata/step_doc_missing_tree": "core.md §5.1",
    "invalid/metadata/malformed_tree": "core.md §5.3",
    # limit_exceeded
    "hostile/shape_product_overflow": "core.md §6 item 1",
    "hostile/huge_shape_few_shards": "core.md §6 item 4",
    "hostile/inner_chunks_2_pow_24": "core.md §6 item 4",
    "hostile/inner_chunk_over_2_gib": "core.md §6 item 4",
    "invalid/metadata/tree_too_deep": "core.md §5.3 item 2",
    # inconsistent_metadata
    "invalid/metadata/inner_chunk_not_dividing": "core.md §6 item 4",
    "invalid/metadata/rank_mismatch": "core.md §6 item 1",
    "invalid/metadata/array_not_in_consolidated": "core.md §5.3 item 1",
    "invalid/commit/extra_file_entry": "core.md §8 item 3",
    "invalid/names/name_key_mismatch": "core.md §5.2 item 3",
    # invalid_name
    "hostile/symlink_shard_outside": "core.md §3 item 2",
    "hostile/symlink_commit_outside": "core.md §3 item 2",
    "hostile/symlink_step_outside": "core.md §3 item 2",
    "hostile/path_escape_array_key": "core.md §3 item 2",
    "hostile/path_escape_escaped_slash": "core.md §3 item 2",
    "hostile/absolute_array_key": "core.md §3 item 2",
    "hostile/absolute_path_in_commit": "core.md §7 item 5",
    "hostile/parent_path_in_commit": "core.md §7 item 5",
    "hostile/backslash_path_in_commit": "core.md §7 item 5",
    "hostile/nul_in_commit_path": "core.md §7 item 5",
    "hostile/nul_in_name": "core.md §5.2 item 1",
    "hostile/nul_in_name_attribute": "core.md §5.2 item 1",
    "hostile/escape_in_name_attribute": "core.md §5.2 item 1",
    "hostile/lone_surrogate_in_name": "core.md §5.2 item 1",
    # not_found, unknown_extension, unsupported_version
    "invalid/metadata/missing_repository_document": "core.md §3.1",
    "invalid/metadata/unknown_codec": "core.md §6 item 4",
    "invalid/metadata/unknown_repository_extension": "core.md §3.1",
    "invalid/metadata/unsupported_repository_version": "core.md §3.1",
    "invalid/commit/unknown_must_understand_extension": "core.md §7 item 5",
    "invalid/commit/unsupported_version": "core.md §7 item 5",
    # packed members of a version 3 step document (core.md §5.1 "Packed members", items 1-4)
    **{f"invalid/metadata/packed_{what}": f"core.md §5.1 item {item}" for what, item in (
        ("not_a_string", 1), ("not_base64", 1), ("base64_unpadded", 1), ("not_a_zstd_frame", 1),
        ("frame_without_content_size", 1), ("frame_with_dictionary", 1), ("declares_1_byte", 1),
        ("declares_more_than_content", 2), ("data_after_frame", 2), ("skippable_frame_after_frame", 2),
        ("content_not_json", 3), ("content_depth_128", 3), ("content_not_an_object", 4),
        ("content_other_member", 4), ("member_also_unpacked", 4), ("consolidated_metadata_twice", 4),
        ("in_version_1", 4), ("in_version_2", 4),
    )},
    "hostile/packed_declares_over_256_mib": "core.md §5.1 item 1",
}


def cite(section: str, fixture: str, expected: dict[str, Any]) -> str:
    """The citation of a case: the section or item of spec/core.md that states the condition of its
    expected code, or the module's own section (valid results; layout.md and delta.md cases)."""
    code = expected.get("code")
    if code is None or not section.startswith("core.md"):
        return section
    return _BY_FIXTURE.get(fixture) or _BY_CODE.get(code) or section

# spec sections (spec/delta.md)
S_GRAD = "delta.md §8 Extension: gradient records"
S_GRAD_SEM = "delta.md §8.1 Semantics"
S_GRAD_VAL = "delta.md §8.3 Validation"

assert sys.byteorder == "little", "expected data is computed from host bytes"


def le_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def sha(t: torch.Tensor, box: list[list[int]] | None = None) -> str:
    if box is not None:
        t = t[tuple(slice(a, b) for a, b in box)]
    return hashlib.sha256(le_bytes(t)).hexdigest()


class Suite:
    """Cases by feature, in declaration order."""

    def __init__(self) -> None:
        self.by_feature: dict[str, list[dict[str, Any]]] = {}

    def add(
        self,
        feature: str,
        description: str,
        section: str,
        fixture: str,
        operation: str,
        args: dict[str, Any] | None = None,
        level: int | None = None,
        **expected: Any,
    ) -> None:
        """``level``: the case's level when its section does not tell it (1 for a case that cites
        spec/core.md on a fixture that needs spec/layout.md or spec/delta.md to read)."""
        if level is None:
            level = 1 if section.startswith(("delta.md", "layout.md")) else 0
        self.by_feature.setdefault(feature, []).append(
            {
                "description": description,
                "spec": cite(section, fixture, expected),
                **({"level": level} if level else {}),
                "fixture": fixture,
                "operation": operation,
                "args": args or {},
                "expected": {k: v for k, v in expected.items() if v is not None},
            }
        )

    def cases(self, feature: str) -> Cases:
        return Cases(self, feature)


class Cases:
    """The cases of one feature (one case file); a file exists once its first case is added."""

    def __init__(self, suite: Suite, feature: str) -> None:
        self.suite = suite
        self.feature = feature

    def add(
        self,
        description: str,
        section: str,
        fixture: str,
        operation: str,
        args: dict[str, Any] | None = None,
        **expected: Any,
    ) -> None:
        self.suite.add(self.feature, description, section, fixture, operation, args, **expected)

    def valid(
        self, desc: str, section: str, fx: str, op: str, args: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        self.add(desc, section, fx, op, args, verdict="valid", **kw)

    def invalid(
        self, desc: str, section: str, fx: str, code: str, args: dict[str, Any] | None = None
    ) -> None:
        self.add(desc, section, fx, "validate", args, verdict="invalid", code=code)

    def error(
        self,
        desc: str,
        section: str,
        fx: str,
        op: str,
        code: str,
        args: dict[str, Any] | None = None,
        may_fail_with: list[str] | None = None,
    ) -> None:
        self.add(desc, section, fx, op, args, verdict="error", code=code, may_fail_with=may_fail_with)

    def reads(
        self,
        section: str,
        fx: str,
        tensors: dict[str, torch.Tensor],
        step: int | None = None,
        boxes: dict[str, list[list[list[int]]]] | None = None,
        what: Callable[[str], str] | None = None,
        may_fail_with: list[str] | None = None,
        level: int | None = None,
    ) -> None:
        """One case per tensor (and per box); ``what(name)`` is appended to the descriptions."""
        for name, t in tensors.items():
            a = {"tensor": name} if step is None else {"tensor": name, "step": step}
            tail = "" if what is None else what(name)
            self.valid(
                f"read {name!r} whole ({t.dtype}, shape {list(t.shape)}){tail}",
                section,
                fx,
                "read",
                a,
                data_sha256=sha(t),
                shape=list(t.shape),
                may_fail_with=may_fail_with,
                level=level,
            )
            for box in (boxes or {}).get(name, []):
                self.valid(
                    f"read {name!r}[{', '.join(f'{a}:{b}' for a, b in box)}]{tail}",
                    section,
                    fx,
                    "read",
                    {**a, "slice": box},
                    data_sha256=sha(t, box),
                    shape=[b - a for a, b in box],
                    may_fail_with=may_fail_with,
                    level=level,
                )

    def broken_read(
        self,
        fx: str,
        tensor: str,
        code: str,
        what: str,
        section: str = S_INTEGRITY,
        box: list[list[int]] | None = None,
    ) -> None:
        """Reading ``tensor`` (or a box of it) fails with ``code``; ``what`` ends the description."""
        args: dict[str, Any] = {"tensor": tensor}
        if box is not None:
            args["slice"] = box
        self.error(f"reading {tensor!r} {what}", section, fx, "read", code, args)
