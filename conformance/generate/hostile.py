"""``cases/hostile.json``: inputs built to hurt a reader (core.md §8.4 limits; §3, §5.2, §6.1, §7).

Records that claim shards of 2^63-1 bytes, shapes of 2^63 or of terabytes, shard indexes that point past
their file, wrap around or overlap, decompression bombs, paths and symbolic links out of the repository,
names with NUL or terminal escapes, and JSON nested 100,000 deep. A reader must refuse each with its code,
without the allocation, seek, enumeration or recursion the lie asks for.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Any

import numcodecs
import torch

from .fixture import EMPTY64, Fx, multi, random_tensor, rename_key, sub_json, tiny
from .suite import S_COMMIT, S_INTEGRITY, S_JSON, S_LAYOUT, S_LIMITS, S_NAMES, S_SHARD, S_STEP_DOC, Cases


def deep_attr(d: dict[str, Any]) -> None:
    """A user attribute of 800 nested lists."""
    node: Any = 0
    for _ in range(800):
        node = [node]
    d["attributes"]["user"] = {"deep": node}


def many(d: dict[str, Any]) -> None:
    """1,000 group entries in consolidated metadata."""
    m = d["consolidated_metadata"]["metadata"]
    for i in range(1000):
        m[f"g{i}"] = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def sizes_and_shapes(root: Path, cases: Cases) -> None:
    """Commit records and array documents that lie about sizes and shapes."""
    fx = "hostile/lying_size_huge"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, (1 << 63) - 1))
    cases.invalid("the commit record claims a shard of 2^63-1 bytes", S_LIMITS, fx, "size_mismatch")
    cases.broken_read(
        fx, "w", "size_mismatch", "when the record claims 2^63-1 bytes (no allocation, no seek)"
    )

    fx = "hostile/lying_size_small"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, 3))
    cases.invalid(
        "the commit record claims a 3-byte shard (smaller than its index)", S_LIMITS, fx, "size_mismatch"
    )
    cases.broken_read(fx, "w", "size_mismatch", "when the record claims fewer bytes than an index needs")

    fx = "hostile/lying_step_document_size"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"]["zarr.json"].__setitem__(0, 1 << 40))
    cases.invalid("the commit record claims a 1 TiB step document", S_LIMITS, fx, "size_mismatch")
    cases.error(
        "a step whose document size is a lie does not open",
        S_LIMITS,
        fx,
        "open",
        "size_mismatch",
        {"step": 1},
    )

    fx = "hostile/shape_2_pow_63"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [1 << 63, 3]))
    cases.invalid("a dimension of 2^63", S_LIMITS, fx, "schema_violation")
    cases.error(
        "a step with a 2^63 dimension does not open", S_LIMITS, fx, "open", "schema_violation", {"step": 1}
    )

    fx = "hostile/shape_product_overflow"
    f, st = tiny(root, fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 31, 1 << 31, 1 << 31]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [4, 3, 1]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [4, 3, 1]),
        ),
    )
    cases.invalid("dimensions each valid whose product exceeds 2^62 bytes", S_LIMITS, fx, "limit_exceeded")
    cases.error(
        "a step whose tensor would exceed 2^62 bytes does not open",
        S_LIMITS,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )

    fx = "hostile/negative_shape"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [-4, 3]))
    cases.invalid("a negative dimension", S_LIMITS, fx, "schema_violation")

    fx = "hostile/float_shape"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [4.0, 3]))
    cases.invalid("a dimension written as a float", S_LIMITS, fx, "schema_violation")

    fx = "hostile/float_sizes_in_commit"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, float(d["files"]["w/c/0/0"][0])))
    cases.invalid(
        "a commit record whose sizes are written as floats (72.0)", S_COMMIT, fx, "corrupt_commit_record"
    )
    cases.error(
        "a step whose record holds float sizes does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )

    fx = "hostile/huge_shape_few_shards"
    f, st = tiny(root, fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 36, 3]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [1 << 34, 3]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [4, 3]),
        ),
    )
    cases.invalid(
        "a 768 GiB tensor of 4 shards, 2^32 inner chunks each, with one small shard on disk",
        S_LIMITS,
        fx,
        "limit_exceeded",
    )

    fx = "hostile/huge_shape_many_shards"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d.__setitem__("shape", [1 << 40, 3]))
    cases.invalid(
        "a 12 TiB tensor of 2^38 shards with one shard on disk: no enumeration of the grid",
        S_LIMITS,
        fx,
        "missing_shard",
    )
    cases.broken_read(
        fx,
        "w",
        "missing_shard",
        "the last row of a 2^40-row tensor whose shard is absent",
        box=[[(1 << 40) - 1, 1 << 40], [0, 3]],
    )
    cases.add(
        "reading a whole 12 TiB tensor of which one shard exists",
        S_LIMITS,
        fx,
        "read",
        {"tensor": "w"},
        verdict="error",
        code="missing_shard",
        may_fail_with=["limit_exceeded"],
    )

    fx = "hostile/inner_chunks_2_pow_24"
    f, st = tiny(root, fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 25, 3]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [1 << 25, 3]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [1, 3]),
        ),
    )
    cases.invalid("a shard index claiming 2^25 inner chunks", S_LIMITS, fx, "limit_exceeded")
    cases.error(
        "a step claiming 2^25 inner chunks per shard does not open",
        S_LIMITS,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )

    fx = "hostile/inner_chunk_over_2_gib"
    f, st = tiny(root, fx)
    f.edit_array(
        1,
        "w",
        lambda d: (
            d.__setitem__("shape", [1 << 30, 3]),
            d["chunk_grid"]["configuration"].__setitem__("chunk_shape", [1 << 30, 3]),
            d["codecs"][0]["configuration"].__setitem__("chunk_shape", [1 << 30, 3]),
        ),
    )
    cases.invalid("an inner chunk of 12 GiB", S_LIMITS, fx, "limit_exceeded")


def shard_indexes(root: Path, cases: Cases) -> None:
    """Shard indexes (with valid crc32c's, resealed) that point where they must not."""
    fx = "hostile/index_beyond_eof"
    f, st = multi(root, fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1][0] = 1 << 40
    f.put_shard_index(1, "w/c/0/0", idx)
    cases.invalid(
        "a (sealed) index entry pointing 1 TiB past the end of its shard",
        S_SHARD,
        fx,
        "corrupt_shard_index",
    )
    cases.broken_read(fx, "w", "corrupt_shard_index", "through an index entry beyond the end of the file")

    fx = "hostile/index_offset_wraps"
    f, st = multi(root, fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1] = [EMPTY64 - 8, 64]
    f.put_shard_index(1, "w/c/0/0", idx)
    cases.invalid(
        "an index entry whose offset + nbytes wraps around 2^64", S_SHARD, fx, "corrupt_shard_index"
    )
    cases.broken_read(fx, "w", "corrupt_shard_index", "through an entry whose end wraps around")

    fx = "hostile/index_entries_overlap"
    f, st = multi(root, fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1] = list(idx[0])
    f.put_shard_index(1, "w/c/0/0", idx)
    cases.invalid("two index entries pointing at the same bytes", S_SHARD, fx, "corrupt_shard_index")
    cases.broken_read(fx, "w", "corrupt_shard_index", "through overlapping index entries")

    fx = "hostile/index_wrong_length"
    f, st = multi(root, fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[0][1] -= 8
    f.put_shard_index(1, "w/c/0/0", idx)
    cases.invalid(
        "an uncompressed chunk's index length differs from its inner chunk size + 4",
        S_SHARD,
        fx,
        "corrupt_shard_index",
    )
    cases.broken_read(fx, "w", "corrupt_shard_index", "through an entry of the wrong length")

    fx = "hostile/index_half_empty"
    f, st = multi(root, fx)
    idx = f.shard_index("steps/1/w/c/0/0", 2)
    idx[1][1] = EMPTY64
    f.put_shard_index(1, "w/c/0/0", idx)
    cases.invalid("an index entry with an offset and an 'absent' length", S_SHARD, fx, "corrupt_shard_index")
    cases.broken_read(fx, "w", "corrupt_shard_index", "through a half-empty entry")

    fx = "hostile/index_chunk_absent"
    f, st = multi(root, fx)
    idx = f.shard_index("steps/1/w/c/1/1", 2)
    idx[1] = [EMPTY64, EMPTY64]
    f.put_shard_index(1, "w/c/1/1", idx)
    cases.invalid(
        "an in-bounds inner chunk marked absent (a hole: never zeros)",
        S_INTEGRITY,
        fx,
        "corrupt_shard_index",
    )
    cases.broken_read(fx, "w", "corrupt_shard_index", "across a hole (never zeros)")

    fx = "hostile/index_outside_chunk_present"
    f, st = multi(root, fx)
    # shard (2, 0) of w holds rows 8..9: its second inner chunk (rows 10..11) lies outside the array
    assert f.shard_index("steps/1/w/c/2/0", 2)[1] == [EMPTY64, EMPTY64]
    first = f.read("steps/1/w/c/2/0")[:28]
    f.put_shard(1, "w/c/2/0", [first[:-4], first[:-4]])
    cases.invalid("an inner chunk wholly outside the array is present", S_SHARD, fx, "corrupt_shard_index")


def zstd_frames(root: Path, cases: Cases) -> None:
    """Compressed chunks (with valid crc32c's) that do not decompress to their inner chunk."""
    fx = "hostile/zstd_bomb"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1400)}, 1, compression="zstd")
    # a zstd frame that declares, and really holds, 1 GiB of zeros in 8192 RLE blocks (32 KiB on disk)
    frame = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", 1 << 30))
    block = ((1 << 17) << 3) | (1 << 1)  # RLE block of 128 KiB
    for i in range(8192):
        frame += struct.pack("<I", block | (i == 8191))[:3] + b"\x00"
    f.put_shard(1, "w/c/0/0", [bytes(frame)])
    cases.invalid(
        "a compressed chunk that expands to 1 GiB (its array holds 400 bytes)",
        S_LIMITS,
        fx,
        "integrity_error",
    )
    cases.broken_read(fx, "w", "integrity_error", "through a decompression bomb (no 1 GiB allocation)")

    fx = "hostile/zstd_bomb_without_content_size"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1430)}, 1, compression="zstd")
    # no declared size (a 128 KiB window), 8 RLE blocks of 128 KiB: 1 MiB for a 400-byte chunk
    frame = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0x00, 7 << 3]))
    for i in range(8):
        frame += struct.pack("<I", block | (i == 7))[:3] + b"\x00"
    f.put_shard(1, "w/c/0/0", [bytes(frame)])
    cases.invalid(
        "a compressed chunk without a declared size that expands past its inner chunk",
        S_LIMITS,
        fx,
        "integrity_error",
    )
    cases.broken_read(fx, "w", "integrity_error", "through a chunk that expands past its size")
    fx = "hostile/zstd_not_a_frame"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1410)}, 1, compression="zstd")
    f.put_shard(1, "w/c/0/0", [b"definitely not zstd"])
    cases.invalid(
        "a compressed chunk (with a valid crc32c) that is not a zstd frame",
        S_INTEGRITY,
        fx,
        "integrity_error",
    )
    cases.broken_read(fx, "w", "integrity_error", "through a chunk that does not decompress")

    fx = "hostile/zstd_short_frame"
    f = Fx(root, fx)
    f.save({"w": random_tensor((10, 10), torch.float32, 1420)}, 1, compression="zstd")
    f.put_shard(1, "w/c/0/0", [bytes(numcodecs.Zstd(level=1).encode(bytes(200)))])
    cases.invalid(
        "a compressed chunk that expands to half its inner chunk size", S_INTEGRITY, fx, "integrity_error"
    )
    cases.broken_read(fx, "w", "integrity_error", "through a short chunk (never padded with zeros)")


def paths(root: Path, cases: Cases) -> None:
    """Paths that leave the step or the repository, and names a terminal or a C string would misread."""
    fx = "hostile/path_escape_array_key"
    f, st = tiny(root, fx)
    rename_key(f, "w", "../../../../etc/passwd")
    cases.invalid(
        "consolidated metadata names an array at '../../../../etc/passwd'", S_NAMES, fx, "invalid_name"
    )
    cases.error(
        "a step with a path-escaping array key does not open",
        S_NAMES,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )

    fx = "hostile/path_escape_escaped_slash"
    f, st = tiny(root, fx)
    rename_key(f, "w", "..%2F..%2Fetc")
    cases.invalid("a key hiding '../..' behind escaped slashes", S_NAMES, fx, "invalid_name")

    fx = "hostile/absolute_array_key"
    f, st = tiny(root, fx)
    rename_key(f, "w", "/etc/passwd")
    cases.invalid("consolidated metadata names an array at an absolute path", S_NAMES, fx, "invalid_name")

    fx = "hostile/absolute_path_in_commit"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("/etc/passwd", [10, 0]))
    cases.invalid("a commit record listing /etc/passwd", S_LAYOUT, fx, "invalid_name")
    cases.error(
        "a step whose record lists an absolute path does not open",
        S_LAYOUT,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )

    fx = "hostile/parent_path_in_commit"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("../../zarr.json", [10, 0]))
    cases.invalid("a commit record listing a file outside its step", S_LAYOUT, fx, "invalid_name")

    fx = "hostile/backslash_path_in_commit"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("..\\..\\zarr.json", [10, 0]))
    cases.invalid("a commit record listing a path with backslashes", S_LAYOUT, fx, "invalid_name")

    fx = "hostile/nul_in_commit_path"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"].__setitem__("w/c/0/0\u0000.txt", [10, 0]))
    cases.invalid("a commit record listing a path with NUL", S_LAYOUT, fx, "invalid_name")

    fx = "hostile/nul_in_name"
    f, st = tiny(root, fx)
    rename_key(f, "w", "a%00b")
    cases.invalid("a key that decodes to a name with NUL", S_NAMES, fx, "invalid_name")

    fx = "hostile/nul_in_name_attribute"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "w\u0000"))
    cases.invalid("attributes.ucl.name with a NUL", S_NAMES, fx, "invalid_name")

    fx = "hostile/escape_in_name_attribute"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "\u001b[31mred"))
    cases.invalid("attributes.ucl.name with a terminal escape sequence", S_NAMES, fx, "invalid_name")

    fx = "hostile/lone_surrogate_in_name"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "w\ud800"))
    cases.invalid("attributes.ucl.name with a lone surrogate (\\ud800 in JSON)", S_NAMES, fx, "invalid_name")

    fx = "hostile/symlink_shard_outside"
    f, st = tiny(root, fx)
    f.p("steps/1/w/c/0/0").unlink()
    f.p("steps/1/w/c/0/0").symlink_to("/etc/passwd")
    cases.invalid("a shard that is a symbolic link to /etc/passwd", S_LAYOUT, fx, "invalid_name")
    cases.broken_read(
        fx, "w", "invalid_name", "through a symbolic link out of the repository", section=S_LAYOUT
    )

    fx = "hostile/symlink_commit_outside"
    f, st = tiny(root, fx)
    f.p("commits/2.json").symlink_to("../../../valid/largest_step/commits/9223372036854775807.json")
    cases.invalid("commits/2.json is a symbolic link to another repository", S_LAYOUT, fx, "invalid_name")
    cases.error(
        "a step whose commit record is a symbolic link out of the repository does not open",
        S_LAYOUT,
        fx,
        "open",
        "invalid_name",
        {"step": 2},
    )

    fx = "hostile/symlink_step_outside"
    f, st = tiny(root, fx, seed=700)  # the same data as valid/largest_step
    shutil.rmtree(f.p("steps/1"))
    f.p("steps/1").symlink_to("../../../valid/largest_step/steps/9223372036854775807")
    cases.invalid("steps/1 is a symbolic link to a step of another repository", S_LAYOUT, fx, "invalid_name")
    cases.error(
        "a step whose folder is a symbolic link out of the repository does not open",
        S_LAYOUT,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )


def parsers(root: Path, cases: Cases) -> None:
    """JSON that attacks the parser, and counts and step numbers past what a reader may assume."""
    deep = b"[" * 100_000 + b"]" * 100_000
    fx = "hostile/deeply_nested_step_document"
    f, st = tiny(root, fx)
    f.put("steps/1/zarr.json", deep)
    f.reseal(1, "zarr.json")
    cases.invalid("a step document nested 100,000 levels deep", S_LIMITS, fx, "limit_exceeded")
    cases.error(
        "a step with a 100,000-level document does not open (no stack overflow)",
        S_LIMITS,
        fx,
        "open",
        "limit_exceeded",
        {"step": 1},
    )

    fx = "hostile/deeply_nested_commit_record"
    f, st = tiny(root, fx)
    f.put("commits/1.json", b'{"a":' * 10_000 + b"1" + b"}" * 10_000)
    cases.invalid("a commit record nested 10,000 objects deep", S_LIMITS, fx, "corrupt_commit_record")

    fx = "hostile/deeply_nested_repository_document"
    f, st = tiny(root, fx)
    f.put("zarr.json", deep[:10_000] + deep[-10_000:])
    cases.invalid("a repository document nested 10,000 levels deep", S_LIMITS, fx, "limit_exceeded")

    fx = "hostile/deep_json_in_attribute"
    f, st = tiny(root, fx)

    f.edit_array(1, "w", deep_attr)
    cases.invalid("a user attribute nested 800 levels deep (the limit is 128)", S_JSON, fx, "limit_exceeded")
    cases.broken_read(fx, "w", "limit_exceeded", "next to an 800-level attribute (never a stack overflow)",
                      section=S_JSON)

    fx = "hostile/huge_integer_literal"
    f, st = tiny(root, fx)
    raw = f.read("steps/1/zarr.json")
    f.put("steps/1/zarr.json", sub_json(raw, b'"step": 1,', b'"step": 1' + b"0" * 20_000 + b","))
    f.reseal(1, "zarr.json")
    cases.invalid(
        "a step number of 20,001 digits (quadratic integer parsing)", S_LIMITS, fx, "schema_violation"
    )

    fx = "hostile/nan_in_json"
    f, st = tiny(root, fx)
    raw = f.read("steps/1/zarr.json")
    f.put("steps/1/zarr.json", sub_json(raw, b'"fill_value": 0.0', b'"fill_value": NaN'))
    f.reseal(1, "zarr.json")
    cases.invalid("NaN in a step document (not JSON)", S_LIMITS, fx, "schema_violation")
    cases.error(
        "a step whose document contains NaN does not open",
        S_LIMITS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "hostile/infinity_in_commit"
    f, st = tiny(root, fx)
    raw = f.read("commits/1.json")
    f.put("commits/1.json", sub_json(raw, b'"parent": null', b'"parent": Infinity'))
    cases.invalid("Infinity in a commit record (not JSON)", S_LIMITS, fx, "corrupt_commit_record")

    fx = "hostile/invalid_utf8_json"
    f, st = tiny(root, fx)
    raw = f.read("steps/1/zarr.json")
    f.put("steps/1/zarr.json", sub_json(raw, b'"kind": "full"', b'"kind": "f\xffull"'))
    f.reseal(1, "zarr.json")
    cases.invalid("a step document that is not UTF-8", S_LIMITS, fx, "schema_violation")

    fx = "hostile/json_not_an_object"
    f, st = tiny(root, fx)
    f.put("steps/1/zarr.json", b"[1, 2, 3]")
    f.reseal(1, "zarr.json")
    cases.invalid("a step document that is JSON but not an object", S_LIMITS, fx, "schema_violation")
    cases.error(
        "a step whose document is not an object does not open",
        S_LIMITS,
        fx,
        "open",
        "schema_violation",
        {"step": 1},
    )

    fx = "hostile/json_null_repository_document"
    f, st = tiny(root, fx)
    f.put("zarr.json", b"null")
    cases.invalid("a repository document that is JSON null", S_LIMITS, fx, "schema_violation")

    fx = "hostile/many_consolidated_entries"
    f, st = tiny(root, fx)

    f.edit_step_doc(1, many)
    cases.valid(
        "1,000 group entries in consolidated metadata: harmless, still valid", S_STEP_DOC, fx, "validate"
    )

    fx = "hostile/step_number_overflow"
    f, st = tiny(root, fx)
    f.put("commits/9223372036854775808.json", f.read("commits/1.json"))
    f.put("commits/99999999999999999999999.json", f.read("commits/1.json"))
    f.put("commits/-1.json", f.read("commits/1.json"))
    cases.valid(
        "commit files named beyond 2^63-1 or negative are not steps", S_COMMIT, fx, "list_steps", steps=[1]
    )
    cases.valid("and are not taken as the latest step", S_COMMIT, fx, "open", step=1, keys=["s", "w"])
    cases.valid("and do not make the repository invalid", S_COMMIT, fx, "validate")


def build(root: Path, cases: Cases) -> None:
    sizes_and_shapes(root, cases)
    shard_indexes(root, cases)
    zstd_frames(root, cases)
    paths(root, cases)
    parsers(root, cases)
