"""What a rank tells the coordinator of its save plan: a summary of ~100 bytes instead of the plan.

A layout save's coordinator must know every array of the step and that every chunk holding data is
written by exactly one rank (:func:`ucl.plan.layout_save.merge_plans`). Gathering every rank's plan for
that costs the coordinator O(world x plan) bytes and time: 94 MB and 17 s at 256 simulated ranks of a
70B model (bench/scale.py). But ranks that differ only in their data-parallel coordinate hold the same
arrays, and which chunks a rank writes is checkable without listing them:

- each rank sends a :class:`PlanSummary`: digests of its layout and mesh and of its arrays, and the
  number and a 128-bit multiset hash of the chunks it writes (a sum of per-chunk hashes, so the
  coordinator can compare the sum over all ranks with the sum over the chunks that hold data: a chunk
  written twice and another not at all changes the sum), and the statements it matched as bitmasks;
- the coordinator asks one rank per distinct arrays digest for the arrays it lacks
  (:func:`missing`), then checks the whole step with :func:`check` -- the same checks as
  ``merge_plans``, so any step ``check`` accepts ``merge_plans`` accepts with the same arrays.

``check`` only says whether the summaries verify; when they do not (an uneven split, a rank's error, two
ranks disagreeing on an array), the caller runs the full protocol, whose ``merge_plans`` names the
problem exactly. No I/O, no torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ucl.layout.mesh import Mesh
from ucl.layout.model import Layout
from ucl.plan.items import ArraySpec, RankPlan
from ucl.plan.layout_save import stored_chunks

_MOD = 1 << 128


def digest(obj: Any) -> bytes:
    """16 bytes of blake2b over the canonical JSON of ``obj`` (sorted keys, no whitespace)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def spec_digests(arrays: Mapping[str, ArraySpec]) -> dict[str, bytes]:
    """Each array's digest (equal digests: equal specs)."""
    return {name: digest(spec.to_dict()) for name, spec in arrays.items()}


def chunk_hash(name: str, index: Sequence[int]) -> int:
    """A 128-bit hash of chunk ``index`` of array ``name``."""
    key = name.encode() + b"\0" + ",".join(map(str, index)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")


@dataclass(frozen=True)
class PlanSummary:
    """A rank's plan as the coordinator checks it (every field O(1) in the world size)."""

    rank: int  # the rank in the mesh
    config: bytes  # digest of the layout and mesh
    arrays: bytes  # digest of the rank's arrays (names and specs)
    writes: int  # how many chunks the rank writes
    coverage: int  # sum of chunk_hash over them, mod 2**128
    matched: tuple[int, int, int]  # bitmasks of the rules, renumbers and flats that matched a tensor

    def to_tuple(self) -> tuple[Any, ...]:
        return (self.rank, self.config, self.arrays, self.writes, self.coverage, self.matched)

    @classmethod
    def from_tuple(cls, t: Sequence[Any]) -> PlanSummary:
        matched = (int(t[5][0]), int(t[5][1]), int(t[5][2]))
        return cls(int(t[0]), bytes(t[1]), bytes(t[2]), int(t[3]), int(t[4]), matched)


def _mask(indices: Sequence[int]) -> int:
    out = 0
    for i in indices:
        out |= 1 << i
    return out


def summarize(plan: RankPlan, digests: Mapping[str, bytes]) -> PlanSummary:
    """The summary of ``plan`` (``digests``: :func:`spec_digests` of its arrays)."""
    coverage = sum(chunk_hash(w.array.name, w.chunk_index) for w in plan.writes) % _MOD
    m = plan.matched
    return PlanSummary(
        plan.rank,
        digest([plan.layout_json, plan.mesh_json]),
        digest(sorted((n, d.hex()) for n, d in digests.items())),
        len(plan.writes),
        coverage,
        (_mask(m.get("rules", [])), _mask(m.get("renumbers", [])), _mask(m.get("flats", []))),
    )


def representatives(summaries: Sequence[PlanSummary], have: bytes) -> list[int]:
    """One rank (index in ``summaries``) per distinct arrays digest other than ``have`` (the
    coordinator's own): the ranks asked for arrays."""
    first: dict[bytes, int] = {}
    for i, s in enumerate(summaries):
        if s.arrays != have:
            first.setdefault(s.arrays, i)
    return sorted(first.values())


def missing(arrays: Mapping[str, ArraySpec], digests: Mapping[str, bytes],
            have: Mapping[str, bytes]) -> list[tuple[bytes, dict[str, Any]]]:
    """The arrays a representative sends, with their digests: those the coordinator lacks, or holds with
    another digest (a disagreement, which :func:`check` then finds)."""
    return [(d, arrays[n].to_dict()) for n, d in digests.items() if have.get(n) != d]


def check(
    layout: Layout,
    mesh: Mesh,
    summaries: Sequence[PlanSummary],
    arrays: Mapping[str, ArraySpec],
    digests: Mapping[str, bytes],
    received: Sequence[Sequence[tuple[bytes, Mapping[str, Any]]]],
) -> dict[str, ArraySpec] | None:
    """The step's arrays if the summaries verify, else None (run the full protocol to learn why).

    ``arrays``: the coordinator's own (``digests``: theirs); ``received``: what each representative sent
    (:func:`missing`).
    Verifies what ``merge_plans`` does: one plan per rank of the mesh, one layout and mesh, ranks agreeing
    on every array, every chunk holding data written exactly once (count and multiset hash), every
    statement matched.
    """
    if sorted(s.rank for s in summaries) != list(range(mesh.size)):
        return None
    if len({s.config for s in summaries}) != 1:
        return None
    merged = dict(arrays)
    digests = dict(digests)
    for sent in received:
        for dg, d in sent:
            spec = ArraySpec.from_dict(d)
            if digests.setdefault(spec.name, dg) != dg:
                return None  # two ranks disagree on an array
            merged[spec.name] = spec
    count, coverage = 0, 0
    for name, spec in merged.items():
        for chunk in stored_chunks(spec):
            count += 1
            coverage += chunk_hash(name, chunk)
    if count != sum(s.writes for s in summaries):
        return None
    if coverage % _MOD != sum(s.coverage for s in summaries) % _MOD:
        return None
    rules = renumbers = flats = 0
    for s in summaries:
        rules, renumbers, flats = rules | s.matched[0], renumbers | s.matched[1], flats | s.matched[2]
    if (rules, renumbers, flats) != (_mask(range(len(layout.rules))), _mask(range(len(layout.renumbers))),
                                     _mask(range(len(layout.flats)))):
        return None
    return dict(sorted(merged.items()))
