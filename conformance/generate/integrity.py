"""``cases/integrity.json``: damage on disk (core.md §8 Integrity, §6.1 Shard encoding).

Flipped bits in chunks, crc32c's, shard indexes and documents; truncated, extended, zeroed, deleted and
swapped files. The commit record is left as it was, as a failing disk or a bad copy would. A reader must
report the damage and never return other data, and still reads what the damage does not reach.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .fixture import Fx, multi, random_tensor, tiny
from .suite import S_INTEGRITY, S_SHARD, Cases, sha


def build(root: Path, cases: Cases) -> None:
    fx = "invalid/integrity/bit_flip_in_chunk"
    f, st = multi(root, fx, "w,i")
    f.flip("steps/1/w/c/1/1", 5)  # first inner chunk of shard (1, 1)
    cases.invalid("one flipped bit in an inner chunk", S_INTEGRITY, fx, "checksum_mismatch")
    cases.broken_read(fx, "w", "checksum_mismatch", "through the damaged chunk")
    cases.broken_read(
        fx, "w", "checksum_mismatch", "(a slice inside the damaged chunk)", box=[[4, 5], [3, 4]]
    )
    cases.valid(
        "a slice that avoids the damaged shard still reads correctly",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w", "slice": [[0, 4], [0, 7]]},
        data_sha256=sha(st["w"], [[0, 4], [0, 7]]),
        shape=[4, 7],
    )
    cases.valid(
        "other tensors of the step still read correctly",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "i"},
        data_sha256=sha(st["i"]),
        shape=[6, 6],
    )

    fx = "invalid/integrity/bit_flip_in_chunk_crc"
    f, st = multi(root, fx, "i")
    size = len(f.read("steps/1/i/c/0/1"))
    f.flip("steps/1/i/c/0/1", 3 * 3 * 8 + 2, 0x80)  # the crc32c after the only inner chunk
    cases.invalid("one flipped bit in an inner chunk's crc32c", S_INTEGRITY, fx, "checksum_mismatch")
    cases.broken_read(fx, "i", "checksum_mismatch", "whose chunk crc32c is damaged")
    assert size == 3 * 3 * 8 + 4 + 20

    fx = "invalid/integrity/bit_flip_in_index"
    f, st = multi(root, fx, "v")
    data = f.read("steps/1/v/c/0")
    f.flip("steps/1/v/c/0", len(data) - 4 - 16 * 2 + 1)  # offset of the first inner chunk
    cases.invalid("one flipped bit in a shard index entry", S_SHARD, fx, "checksum_mismatch")
    cases.broken_read(fx, "v", "checksum_mismatch", "whose shard index is damaged")

    fx = "invalid/integrity/bad_index_crc"
    f, st = tiny(root, fx)
    data = f.read("steps/1/w/c/0/0")
    f.flip("steps/1/w/c/0/0", len(data) - 1, 0x10)
    cases.invalid("the index crc32c does not match", S_SHARD, fx, "checksum_mismatch")
    cases.broken_read(fx, "w", "checksum_mismatch", "whose index crc32c is damaged")

    fx = "invalid/integrity/truncated_shard"
    f, st = multi(root, fx)
    f.truncate("steps/1/w/c/2/0", len(f.read("steps/1/w/c/2/0")) - 7)
    cases.invalid("a shard shorter than the commit record says", S_INTEGRITY, fx, "size_mismatch")
    cases.broken_read(fx, "w", "size_mismatch", "with a truncated shard")

    fx = "invalid/integrity/truncated_shard_to_zero"
    f, st = tiny(root, fx)
    f.truncate("steps/1/w/c/0/0", 0)
    cases.invalid("a shard truncated to 0 bytes", S_INTEGRITY, fx, "size_mismatch")
    cases.broken_read(fx, "w", "size_mismatch", "from an empty shard file")

    fx = "invalid/integrity/truncated_shard_index_only"
    f, st = tiny(root, fx)
    data = f.read("steps/1/w/c/0/0")
    f.put("steps/1/w/c/0/0", data[-20:])  # the data part gone, the index kept
    cases.invalid("a shard that lost its data part but kept its index", S_INTEGRITY, fx, "size_mismatch")
    cases.broken_read(fx, "w", "size_mismatch", "from a shard without its data part")

    fx = "invalid/integrity/missing_shard"
    f, st = multi(root, fx, "m")
    f.p("steps/1/m/c/1/0/1").unlink()
    cases.invalid("a shard listed in the commit record is absent", S_INTEGRITY, fx, "missing_shard")
    cases.broken_read(fx, "m", "missing_shard", "with one shard deleted")
    cases.valid(
        "a slice outside the missing shard still reads",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "m", "slice": [[0, 2], [0, 4], [0, 3]]},
        data_sha256=sha(st["m"], [[0, 2], [0, 4], [0, 3]]),
        shape=[2, 4, 3],
    )

    fx = "invalid/integrity/missing_scalar_shard"
    f, st = tiny(root, fx)
    f.p("steps/1/s/c").unlink()
    cases.invalid("the only shard of a 0-d tensor is absent", S_INTEGRITY, fx, "missing_shard")
    cases.broken_read(fx, "s", "missing_shard", "without its shard")

    fx = "invalid/integrity/extended_shard"
    f, st = tiny(root, fx)
    f.put("steps/1/w/c/0/0", f.read("steps/1/w/c/0/0") + b"\x00" * 16)
    cases.invalid("a shard longer than the commit record says", S_INTEGRITY, fx, "size_mismatch")
    cases.add(
        "reading an extended shard: readers need not notice trailing bytes, but must not return other data",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["size_mismatch", "checksum_mismatch", "corrupt_shard_index"],
    )

    fx = "invalid/integrity/zeroed_shard"
    f, st = tiny(root, fx)
    f.put("steps/1/w/c/0/0", bytes(len(f.read("steps/1/w/c/0/0"))))
    cases.invalid("a shard overwritten with zeros (same size)", S_INTEGRITY, fx, "checksum_mismatch")
    cases.broken_read(fx, "w", "checksum_mismatch", "from a zeroed shard (never zeros)")

    fx = "invalid/integrity/bit_flip_in_zstd_chunk"
    f = Fx(root, fx)
    zt = {"w": random_tensor((32, 8), torch.float32, 1000)}
    f.save(zt, 1, compression="zstd")
    f.flip("steps/1/w/c/0/0", 9)
    cases.invalid("one flipped bit in a compressed inner chunk", S_INTEGRITY, fx, "checksum_mismatch")
    cases.broken_read(fx, "w", "checksum_mismatch", "through a damaged compressed chunk")

    fx = "invalid/integrity/bit_flip_in_step_document"
    f, st = tiny(root, fx)
    f.flip("steps/1/zarr.json", 40, 0x02)
    cases.invalid(
        "the step document differs from its commit record's crc32c",
        S_INTEGRITY,
        fx,
        "checksum_mismatch",
    )
    cases.error(
        "a step whose document fails its crc32c does not open",
        S_INTEGRITY,
        fx,
        "open",
        "checksum_mismatch",
        {"step": 1},
    )

    fx = "invalid/integrity/missing_step_document"
    f, st = tiny(root, fx)
    f.p("steps/1/zarr.json").unlink()
    cases.invalid("the step document is absent", S_INTEGRITY, fx, "missing_shard")
    cases.error(
        "a step without its document does not open",
        S_INTEGRITY,
        fx,
        "open",
        "missing_shard",
        {"step": 1},
    )

    fx = "invalid/integrity/bit_flip_in_array_document"
    f, st = tiny(root, fx)
    f.flip("steps/1/w/zarr.json", 30, 0x04)
    cases.invalid("an array document fails its crc32c", S_INTEGRITY, fx, "checksum_mismatch")
    cases.add(
        "readers use the consolidated metadata, so the tensor may still read correctly",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["checksum_mismatch"],
    )

    fx = "invalid/integrity/missing_array_document"
    f, st = tiny(root, fx)
    f.p("steps/1/s/zarr.json").unlink()
    cases.invalid("an array document is absent", S_INTEGRITY, fx, "missing_shard")

    fx = "invalid/integrity/bit_flip_in_group_document"
    f = Fx(root, fx)
    gt = {"a": {"b": random_tensor((2, 2), torch.float32, 1500)}}
    f.save(gt, 1)
    f.flip("steps/1/a/zarr.json", 20, 0x01)
    cases.invalid("an intermediate group document fails its crc32c", S_INTEGRITY, fx, "checksum_mismatch")
    cases.add(
        "readers use the consolidated metadata, so the tensor below may still read",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "a/b"},
        verdict="valid",
        data_sha256=sha(gt["a"]["b"]),
        shape=[2, 2],
        may_fail_with=["checksum_mismatch"],
    )

    fx = "invalid/integrity/missing_group_document"
    f = Fx(root, fx)
    f.save(gt, 1)
    f.p("steps/1/a/zarr.json").unlink()
    cases.invalid(
        "an intermediate group document listed in the commit record is absent",
        S_INTEGRITY,
        fx,
        "missing_shard",
    )

    fx = "invalid/integrity/swapped_shards"
    f, st = multi(root, fx)
    a, b = f.read("steps/1/w/c/0/0"), f.read("steps/1/w/c/1/0")
    assert len(a) == len(b)
    f.put("steps/1/w/c/0/0", b)
    f.put("steps/1/w/c/1/0", a)
    cases.invalid("two equal-sized shards of a tensor swapped", S_INTEGRITY, fx, "checksum_mismatch")
    cases.broken_read(fx, "w", "checksum_mismatch", "whose shards are swapped (never the other shard's data)")
