"""``cases/commit.json``: commit records (core.md §7 Commit protocol; §8 and §9 for what they list).

Records that fail their checksum, are truncated, empty, of another step, kind or version, carry an
unknown field or require an unknown extension; records whose file list or sizes disagree with the step;
and a corrupt newest record, below which the latest step falls back.
"""

from __future__ import annotations

from pathlib import Path

from ucl.format import metadata

from .fixture import Fx, multi, tiny, tiny_state
from .suite import S_COMMIT, S_EXT, S_INTEGRITY, Cases, sha


def build(root: Path, cases: Cases) -> None:
    fx = "invalid/commit/corrupt_commit_checksum"
    f, st = tiny(root, fx)
    doc = f.commit_doc(1)
    doc["checksum"] ^= 1
    f.put("commits/1.json", metadata.dumps(doc))
    cases.invalid("a commit record whose checksum does not match", S_COMMIT, fx, "corrupt_commit_record")
    cases.error(
        "a step whose commit record fails its checksum does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )
    cases.error(
        "the only step's record is corrupt: there is no latest step",
        S_COMMIT,
        fx,
        "open",
        "not_found",
    )
    cases.valid("a step whose record does not verify does not exist", S_COMMIT, fx, "list_steps", steps=[])

    fx = "invalid/commit/bit_flip_in_commit_record"
    f, st = tiny(root, fx)
    raw = f.read("commits/1.json")
    f.flip("commits/1.json", raw.index(b'"2026', raw.index(b'"time":')) + 4, 0x01)  # a digit of the time
    cases.invalid("one flipped bit in a commit record", S_COMMIT, fx, "corrupt_commit_record")
    cases.error(
        "a damaged commit record does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )

    fx = "invalid/commit/step_mismatch"
    f, st = tiny(root, fx)
    f.put("commits/2.json", f.read("commits/1.json"))
    f.p("commits/1.json").unlink()
    cases.invalid("commits/2.json is the (sealed) record of step 1", S_COMMIT, fx, "corrupt_commit_record")
    cases.error(
        "a record naming another step does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 2},
    )

    fx = "invalid/commit/truncated_commit_record"
    f, st = tiny(root, fx)
    f.truncate("commits/1.json", 100)
    cases.invalid("a truncated commit record", S_COMMIT, fx, "corrupt_commit_record")
    cases.error(
        "a truncated commit record does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 1},
    )

    fx = "invalid/commit/empty_commit_record"
    f, st = tiny(root, fx)
    f.put("commits/1.json", b"")
    cases.invalid("an empty commit record file", S_COMMIT, fx, "corrupt_commit_record")

    fx = "invalid/commit/schema_violation"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d.__setitem__("kind", "partial"))
    cases.invalid(
        "a sealed commit record whose kind is not full or delta",
        S_COMMIT,
        fx,
        "corrupt_commit_record",
    )

    fx = "invalid/commit/unknown_field"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d.__setitem__("retention", "forever"))
    cases.invalid(
        "a sealed commit record with an unknown field (fail closed)",
        S_COMMIT,
        fx,
        "corrupt_commit_record",
    )

    fx = "invalid/commit/unknown_must_understand_extension"
    f, st = tiny(root, fx)
    f.edit_commit(
        1, lambda d: d.__setitem__("extensions", [{"name": "example.encryption", "configuration": {}}])
    )
    cases.invalid("a commit record requiring an unknown extension", S_EXT, fx, "unknown_extension")
    cases.error(
        "a step whose record requires an unknown extension does not open",
        S_EXT,
        fx,
        "open",
        "unknown_extension",
        {"step": 1},
    )

    fx = "invalid/commit/unsupported_version"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d.__setitem__("ucl_commit", 3))
    cases.invalid("a commit record of a newer format version", S_EXT, fx, "unsupported_version")
    cases.error(
        "a step committed by a newer version does not open",
        S_EXT,
        fx,
        "open",
        "unsupported_version",
        {"step": 1},
    )

    fx = "invalid/commit/missing_file_entry"
    f, st = multi(root, fx, "i")
    f.edit_commit(1, lambda d: d["files"].pop("i/c/1/1"))
    cases.invalid("a shard of the grid is not listed in the commit record", S_INTEGRITY, fx, "missing_shard")
    cases.broken_read(fx, "i", "missing_shard", "when one of its shards is not in the commit record")

    fx = "invalid/commit/missing_step_document_entry"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"].pop("zarr.json"))
    cases.invalid("the step document is not listed in the commit record", S_INTEGRITY, fx, "missing_shard")
    cases.error(
        "a step whose document is not in its commit record does not open",
        S_INTEGRITY,
        fx,
        "open",
        "missing_shard",
        {"step": 1},
    )

    fx = "invalid/commit/extra_file_entry"
    f, st = tiny(root, fx)
    f.put("steps/1/stray", b"stray bytes")
    f.reseal(1, "stray")
    cases.invalid(
        "the commit record lists a file that no array owns",
        S_INTEGRITY,
        fx,
        "inconsistent_metadata",
    )
    cases.reads(S_INTEGRITY, fx, st)

    fx = "invalid/commit/wrong_shard_size"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(0, d["files"]["w/c/0/0"][0] + 1))
    cases.invalid(
        "the commit record's size of a shard is one byte too large",
        S_INTEGRITY,
        fx,
        "size_mismatch",
    )
    cases.broken_read(fx, "w", "size_mismatch", "when the recorded size is one byte too large")

    fx = "invalid/commit/wrong_shard_crc"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d["files"]["w/c/0/0"].__setitem__(1, d["files"]["w/c/0/0"][1] ^ 1))
    cases.invalid(
        "the commit record's crc32c of a shard does not match the file",
        S_INTEGRITY,
        fx,
        "checksum_mismatch",
    )
    cases.add(
        "readers verify inner chunks, so the data may still be read",
        S_INTEGRITY,
        fx,
        "read",
        {"tensor": "w"},
        verdict="valid",
        data_sha256=sha(st["w"]),
        shape=[4, 3],
        may_fail_with=["checksum_mismatch"],
    )

    fx = "invalid/commit/kind_mismatch"
    f, st = tiny(root, fx)
    f.edit_commit(1, lambda d: d.update(kind="delta", parent=0))
    cases.invalid(
        "the commit record says delta, the step document says full",
        S_COMMIT,
        fx,
        "inconsistent_metadata",
    )
    cases.error(
        "a step whose documents disagree does not open",
        S_COMMIT,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )

    fx = "invalid/commit/newest_record_corrupt"
    f = Fx(root, fx)
    st1, st2 = tiny_state(1100), tiny_state(1110)
    f.save(st1, 1)
    f.save(st2, 2)
    f.truncate("commits/2.json", 50)
    cases.invalid("the newest step's commit record is corrupt", S_COMMIT, fx, "corrupt_commit_record")
    cases.valid(
        "the latest step falls back to the newest record that verifies",
        S_COMMIT,
        fx,
        "open",
        step=1,
        keys=["s", "w"],
    )
    cases.valid("only steps whose records verify exist", S_COMMIT, fx, "list_steps", steps=[1])
    cases.reads(S_COMMIT, fx, st1)
    cases.error(
        "the step with the corrupt record does not open",
        S_COMMIT,
        fx,
        "open",
        "corrupt_commit_record",
        {"step": 2},
    )
