"""``cases/repository.json``: which steps a repository has (core.md §3 Repository layout, §7 Commit).

Steps exist once committed and are listed in order; files of an uncommitted step, an interrupted atomic
write and names that are not a step number are ignored. Also the latest step, the empty repository, and
the largest step number, 2^63-1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ucl.format.repository import Repository
from ucl.plan.save import array_for

from .fixture import Fx, random_tensor, tiny_state
from .suite import S_COMMIT, S_LAYOUT, Cases


def build(root: Path, cases: Cases) -> None:
    # several steps, one uncommitted leftover
    fx = "valid/steps"
    f = Fx(root, fx)
    per_step = {}
    for k, step in enumerate([0, 7, 30]):
        per_step[step] = {"w": random_tensor((3, 4), torch.float32, 600 + k), "n": torch.tensor(step)}
        f.save(per_step[step], step)
    f.write(31, [(array_for("w", per_step[30]["w"]), per_step[30]["w"])], commit=False)
    f.put("commits/32.json.tmp-4242", b'{"ucl_commit": 1, "step": 3')  # an interrupted atomic write
    f.put("commits/README", b"not a commit record\n")
    f.put("commits/007.json", f.read("commits/7.json"))  # not S in decimal without leading zeros
    cases.valid(
        "committed steps listed in order; uncommitted files, temporaries and odd names ignored",
        "core.md §3 item 5",
        fx,
        "list_steps",
        steps=[0, 7, 30],
    )
    cases.valid(
        "latest is the newest committed step, not the uncommitted leftover",
        S_COMMIT,
        fx,
        "open",
        step=30,
        keys=["n", "w"],
    )
    cases.valid("step 0 opens", S_COMMIT, fx, "open", {"step": 0}, step=0, keys=["n", "w"])
    cases.valid(
        "leftover files of an uncommitted step do not make the repository invalid",
        S_COMMIT,
        fx,
        "validate",
    )
    cases.error("an uncommitted step does not open", S_COMMIT, fx, "open", "not_committed", {"step": 31})
    cases.error("a step that was never written", S_COMMIT, fx, "open", "not_found", {"step": 8})
    cases.invalid("validating an uncommitted step", S_COMMIT, fx, "not_committed", {"step": 31})
    for step, st in per_step.items():
        cases.reads(S_COMMIT, fx, st, step=step)

    fx = "valid/empty_repository"
    Repository.open(Fx(root, fx).path, create=True)
    cases.valid("a repository without steps lists none", S_LAYOUT, fx, "list_steps", steps=[])
    cases.valid("a repository without steps is valid", S_LAYOUT, fx, "validate")
    cases.error("the latest step of an empty repository", S_COMMIT, fx, "open", "not_found")

    fx = "valid/largest_step"
    big = (1 << 63) - 1
    st = tiny_state(700)
    Fx(root, fx).save(st, big)
    cases.valid("step 2^63-1 validates", S_COMMIT, fx, "validate")
    cases.valid("step 2^63-1 is listed", S_COMMIT, fx, "list_steps", steps=[big])
    cases.valid("step 2^63-1 opens", S_COMMIT, fx, "open", step=big, keys=["s", "w"])
    cases.reads(S_COMMIT, fx, st)
