"""validate_chain (spec/delta.md §7) over a stand-in repository with the Repository methods it uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ucl.errors import CheckpointNotFoundError, ChecksumError, MissingShardError, UCLError
from ucl.format.records import DeltaRecord
from ucl.tools.validate_chain import validate_chain


@dataclass
class Arr:
    name: str
    delta: dict[str, Any] | None = None
    shape: tuple[int, ...] = (8,)
    dtype: str = "float32"
    chunk_shape: tuple[int, ...] = (8,)
    inner_chunk_shape: tuple[int, ...] = (4,)
    codec: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        return self.name

    @property
    def n_inner(self) -> int:
        n = 1
        for c, i in zip(self.chunk_shape, self.inner_chunk_shape, strict=True):
            n *= c // i
        return n

    def inner_codecs(self) -> list[dict[str, Any]]:
        if self.codec is not None:
            return [self.codec, {"name": "crc32c"}]
        return (
            [DeltaRecord.from_dict(self.delta).codec(), {"name": "crc32c"}]
            if self.delta
            else [{"name": "bytes"}]
        )


@dataclass
class Meta:
    kind: str
    parent: int | None
    arrays: dict[str, Arr]


@dataclass
class Rec:
    files: dict[str, tuple[int, int]]


@dataclass
class Repo:
    metas: dict[int, Meta]
    files: dict[int, dict[str, tuple[int, int]]] = field(default_factory=dict)
    corrupt: set[tuple[int, str]] = field(default_factory=set)
    reads: list[tuple[int, str]] = field(default_factory=list)

    def commit_record(self, s: int) -> Rec:
        if s not in self.metas:
            raise CheckpointNotFoundError(f"step {s} does not exist", file=f"commits/{s}.json")
        return Rec(self.files.get(s, {}))

    def step_meta(self, s: int, rec: Rec) -> Meta:
        return self.metas[s]

    def read_verified(self, s: int, rel: str, rec: Rec, *, n_inner: int | None = None) -> bytes:
        self.reads.append((s, rel))
        if (s, rel) in self.corrupt:
            raise ChecksumError(f"steps/{s}/{rel} fails its crc32c", file=f"steps/{s}/{rel}")
        if rel not in rec.files:
            raise MissingShardError(f"steps/{s}/{rel} is not listed", file=f"steps/{s}/{rel}")
        return b""


def chunked(base: int, enc: str = "xor") -> dict[str, Any]:
    return {"mode": "chunked", "base_step": base, "encoding": enc}


def repo3() -> Repo:
    return Repo(
        metas={
            1: Meta("full", None, {"w": Arr("w"), "f": Arr("f")}),
            2: Meta(
                "delta", 1, {"w": Arr("w", chunked(1)), "f": Arr("f", {"mode": "unchanged", "base_step": 1})}
            ),
            3: Meta(
                "delta",
                2,
                {"w": Arr("w", chunked(2, "sub")), "f": Arr("f", {"mode": "unchanged", "base_step": 2})},
            ),
        },
        files={1: {"w/c/0": (40, 1), "f/c/0": (40, 2)}, 2: {"w/c/0": (20, 3)}, 3: {"w/c/0": (20, 4)}},
    )


def codes(errors: list[UCLError]) -> list[str]:
    return [e.code for e in errors]


def test_a_valid_chain_has_no_errors_and_checks_the_bases() -> None:
    r = repo3()
    assert list(validate_chain(r, 3, r.metas[3])) == []
    assert sorted(r.reads) == [(1, "f/c/0"), (1, "w/c/0"), (2, "w/c/0")]
    r.reads.clear()
    assert list(validate_chain(r, 3, r.metas[3], check_bases=False)) == [] and r.reads == []


def test_a_corrupt_base_breaks_every_dependent_step_naming_the_base() -> None:
    r = repo3()
    r.corrupt.add((1, "w/c/0"))
    for s in (2, 3):
        errs = list(validate_chain(r, s, r.metas[s]))
        assert codes(errs) == ["broken_chain"]
        assert errs[0].message == (
            f"step {s} depends on step 1, whose tensor 'w' is corrupt: [checksum_mismatch] "
            "steps/1/w/c/0 fails its crc32c"
        )
        assert errs[0].tensor == "w" and errs[0].file == "steps/1/w/c/0"


def test_missing_parent_too_long_and_mismatched_arrays() -> None:
    r = repo3()
    del r.metas[1]
    errs = list(validate_chain(r, 3, r.metas[3]))
    assert (
        codes(errs) == ["broken_chain"]
        and "step 1 (parent of step 2, in the chain of step 3) is not readable: [not_found]"
        in errs[0].message
    )
    r = repo3()
    assert codes(list(validate_chain(r, 3, r.metas[3], max_chain=1))) == ["broken_chain"]
    r.metas[2].arrays["w"] = Arr("w", chunked(1), dtype="bfloat16")
    errs = list(validate_chain(r, 3, r.metas[3]))
    assert codes(errs) == ["broken_chain"] and "dtypes differ" in errs[0].message and errs[0].tensor == "w"


def test_bad_records_and_codecs_are_reported_as_such() -> None:
    r = repo3()
    r.metas[3].arrays["w"] = Arr("w", {"mode": "chunked", "base_step": 2})
    errs = list(validate_chain(r, 3, r.metas[3]))
    assert codes(errs) == ["schema_violation"] and "needs encoding" in errs[0].message
    r.metas[3].arrays["w"] = Arr(
        "w", chunked(2), codec={"name": "ucl.delta", "configuration": {"encoding": "sub", "base_step": 2}}
    )
    errs = list(validate_chain(r, 3, r.metas[3]))
    assert codes(errs) == ["inconsistent_metadata"] and "disagrees" in errs[0].message
    r.metas[3].arrays["w"] = Arr("w", chunked(0))
    errs = list(validate_chain(r, 3, r.metas[3]))
    assert (
        codes(errs) == ["broken_chain"] and "base_step 0 is not in the step's parent chain" in errs[0].message
    )
