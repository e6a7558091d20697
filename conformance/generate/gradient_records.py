"""``cases/gradient_records.json``: steps that store one optimizer step's gradients (delta.md §8).

``valid/gradient_records`` is written by the engine (``CheckpointManager`` with
``DeltaPolicy(gradients=True)``); readers rebuild its parameters and optimizer state by replaying AdamW on
the parent (§8.1). Copies of it carry one defect each: extension documents that lie (§8.1), gradients that
do not fit their parameters and a damaged parent (§8.3: broken_chain). The fingerprint records this
generator's torch version: a reader whose optimizer differs, or that does not implement replay, fails with
unknown_extension (§8.2, §8.1.6), which the cases on gradient steps accept.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ucl.format import structure
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy

from .fixture import V1, Fx
from .suite import S_COMMIT, S_GRAD, S_GRAD_SEM, S_GRAD_VAL, S_INTEGRITY, Cases, sha

SOURCE = "valid/gradient_records"
# accepted on every case that needs a replay: a reader without one, or with another optimizer (§8.2)
NO_REPLAY = ["unknown_extension"]


def dyadic(shape: tuple[int, ...], seed: int, scale: int) -> torch.Tensor:
    """float32 multiples of 1/scale from a seeded integer generator: the same bits on every machine (no
    platform-dependent random-normal or matmul kernels are involved)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-96, 97, shape, generator=g).to(torch.float32) / scale


def gradient_run(path: Path, steps: int = 3) -> dict[int, dict[str, torch.Tensor]]:
    """Train a 2-layer MLP with AdamW and save it with the engine's gradient records (spec/delta.md §8).

    Linear(4, 4), Tanh, Linear(4, 2, bias=False): 28 fp32 parameters on the CPU, AdamW with its for-loop
    kernels (``foreach=False``), two parameter groups and a scheduler that halves each learning rate right
    after every step (so a step ran with other hyperparameters than the tree's copy says, §8.1.5). Parameters
    and gradients are dyadic numbers from seeded integer generators, and the gradients are set rather
    than computed by backward, so the state is the same bits on every machine. Step 1 is full; steps 2
    and 3 are gradient records, 3 replayed on 2 replayed on 1; in step 3 ``model/0.bias`` has no
    gradient (AdamW leaves it and its state alone). ``seen`` is not an optimizer tensor: a state delta.
    Returns each step's tensors by name (what a replay must reproduce).
    """
    torch.manual_seed(1900)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(dyadic(tuple(p.shape), 1900 + i, 64))
    groups: list[dict[str, Any]] = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 0.003, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(path, delta=DeltaPolicy(gradients=True), options=V1) as mgr:
        for t in range(1, steps + 1):
            for i, p in enumerate(model.parameters()):
                p.grad = None if (t, i) == (3, 1) else dyadic(tuple(p.shape), 1910 + 10 * t + i, 128)
            opt.step()
            sched.step()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "seen": torch.tensor([t, 8 * t])}
            ref[t] = structure.flatten(copy.deepcopy(state))[0]
            mgr.save(t, state, optimizer=opt)
        mgr.wait()
    (path / ".ucl-writer.lock").unlink(missing_ok=True)  # holds the writer's pid
    return ref


def replayed_what(step: int, no_grad: set[str]) -> Callable[[str], str]:
    """What ends the descriptions of a replayed step's read cases (``no_grad``: no gradient in step 3)."""

    def what(name: str) -> str:
        if name == "seen":
            return f", a state delta of step {step} (not replayed)"
        tail = f": replayed, AdamW on step {step - 1}" + (" (itself replayed)" if step == 3 else "")
        if step == 3 and name in no_grad:
            tail += "; no gradient in this step, so as in step 2"
        return tail

    return what


def grad_copy(root: Path, rel: str, ref: dict[int, dict[str, torch.Tensor]], steps: int = 2) -> Fx:
    """A copy of valid/gradient_records with its first ``steps`` steps (full step 1, then gradients)."""
    f = Fx(root, rel)
    shutil.copytree(root / SOURCE, f.path, dirs_exist_ok=True)
    for s in range(steps + 1, len(ref) + 1):
        shutil.rmtree(f.p(f"steps/{s}"))
        f.p(f"commits/{s}.json").unlink()
    return f


def edit_records(f: Fx, step: int, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Edit the ucl.gradient_records extension of a step (resealed)."""

    def upd(d: dict[str, Any]) -> None:
        (ext,) = [e for e in d["attributes"]["ucl"]["extensions"] if e["name"] == "ucl.gradient_records"]
        fn(ext)

    f.edit_step_doc(step, upd)


def fails_to_open(cases: Cases, fx: str, code: str, what: str, step: int = 2) -> None:
    cases.error(f"a step whose {what} does not open", S_GRAD_SEM, fx, "open", code, {"step": step})


def transposed(d: dict[str, Any]) -> None:
    """The [2, 4] gradient of model/2.weight relabelled [4, 2]."""
    d["shape"] = [4, 2]  # the same eight elements in one inner chunk: the shard's bytes unchanged
    d["chunk_grid"]["configuration"]["chunk_shape"] = [4, 2]
    d["codecs"][0]["configuration"]["chunk_shape"] = [4, 2]


def replayed_steps(root: Path, cases: Cases) -> dict[int, dict[str, torch.Tensor]]:
    """valid/gradient_records: a full step, then two gradient-record steps; returns their tensors."""
    fx = SOURCE
    grad_fx = Fx(root, fx)
    ref = gradient_run(grad_fx.path)
    for step in ref:
        grad_fx.fix_time(step)
    keys = sorted(ref[1])
    assert set(ref[2]) == set(ref[3]) == set(keys) and "seen" in keys
    for step in (2, 3):  # stored as gradients, not as a fallback state delta
        ext = grad_fx.read_json(f"steps/{step}/zarr.json")["attributes"]["ucl"].get("extensions", [])
        assert [e["name"] for e in ext] == ["ucl.gradient_records"], (step, ext)
    no_grad = {n for n in keys if n == "model/0.bias" or n.startswith("optim/state/1/")}
    assert all(torch.equal(ref[3][n], ref[2][n]) == (n in no_grad) for n in keys if n != "seen")

    cases.valid(
        "a full step and two gradient-record steps validate (without replay: unknown_extension)",
        S_GRAD_VAL,
        fx,
        "validate",
        may_fail_with=NO_REPLAY,
    )
    cases.valid("the full step validates on its own", S_GRAD_VAL, fx, "validate", {"step": 1})
    cases.valid(
        "a gradient-record step whose parent is a gradient-record step validates",
        S_GRAD_VAL,
        fx,
        "validate",
        {"step": 3},
        may_fail_with=NO_REPLAY,
    )
    cases.valid("gradient-record steps are steps", S_COMMIT, fx, "list_steps", steps=[1, 2, 3])
    cases.valid("the full step opens", S_GRAD_SEM, fx, "open", {"step": 1}, step=1, keys=keys)
    for step in (2, 3):
        cases.valid(
            f"step {step} lists the replayed parameters and optimizer state, not its grad/ arrays",
            S_GRAD_SEM,
            fx,
            "open",
            {"step": step},
            step=step,
            keys=keys,
            may_fail_with=NO_REPLAY,
        )
    cases.valid(
        "the latest step is the newest gradient-record step",
        S_GRAD_SEM,
        fx,
        "open",
        step=3,
        keys=keys,
        may_fail_with=NO_REPLAY,
    )
    cases.reads(S_GRAD_SEM, fx, ref[1], step=1)
    for step in (2, 3):
        cases.reads(
            S_GRAD_SEM,
            fx,
            ref[step],
            step=step,
            boxes={"model/0.weight": [[[1, 3], [2, 4]]], "optim/state/2/exp_avg_sq": [[[1, 2], [0, 4]]]},
            what=replayed_what(step, no_grad),
            may_fail_with=NO_REPLAY,
        )
    for name in ("grad/model/0.weight", "grad/model/0.bias"):
        cases.error(
            f"the gradient array {name!r} is not a tensor of the step's state",
            S_GRAD_SEM,
            fx,
            "read",
            "tensor_not_found",
            {"tensor": name, "step": 2},
            may_fail_with=NO_REPLAY,
        )
    return ref


def defects(root: Path, cases: Cases, ref: dict[int, dict[str, torch.Tensor]]) -> None:
    """Copies of valid/gradient_records, one defect each."""
    keys = sorted(ref[1])
    fx = "invalid/metadata/gradient_replayed_tensor_stored"
    f = grad_copy(root, fx, ref)
    full = f.read_json("steps/1/zarr.json")["consolidated_metadata"]["metadata"]
    for rel in ("model/zarr.json", "model/0.bias/zarr.json", "model/0.bias/c/0"):
        f.put(f"steps/2/{rel}", f.read(f"steps/1/{rel}"))
    f.edit_step_doc(
        2,
        lambda d: d["consolidated_metadata"]["metadata"].update(
            {k: full[k] for k in ("model", "model/0.bias")}
        ),
    )
    f.reseal(2, "model/zarr.json", "model/0.bias/zarr.json", "model/0.bias/c/0")
    cases.invalid(
        "a replayed parameter is also stored as an array (step 1's, copied)",
        S_GRAD_SEM,
        fx,
        "inconsistent_metadata",
    )
    fails_to_open(cases, fx, "inconsistent_metadata", "replayed parameter is also stored")

    fx = "invalid/metadata/gradient_base_step_not_parent"
    f = grad_copy(root, fx, ref, steps=3)
    edit_records(f, 3, lambda e: e["configuration"].__setitem__("base_step", 1))
    cases.invalid(
        "the extension's base_step (1, an ancestor) is not the step's parent (2)",
        S_GRAD_SEM,
        fx,
        "inconsistent_metadata",
    )
    fails_to_open(cases, fx, "inconsistent_metadata", "base_step is not its parent", step=3)
    cases.valid(
        "the step before it still opens",
        S_GRAD_SEM,
        fx,
        "open",
        {"step": 2},
        step=2,
        keys=keys,
        may_fail_with=NO_REPLAY,
    )

    fx = "invalid/metadata/gradient_parameter_not_in_tree"
    f = grad_copy(root, fx, ref)
    edit_records(f, 2, lambda e: e["configuration"]["parameters"].append("model/4.weight"))
    cases.invalid(
        "the extension names a parameter that the structure tree does not",
        S_GRAD_SEM,
        fx,
        "inconsistent_metadata",
    )
    fails_to_open(cases, fx, "inconsistent_metadata", "gradient records name a parameter not in its tree")

    fx = "invalid/metadata/gradient_param_groups_missing"
    f = grad_copy(root, fx, ref)
    edit_records(f, 2, lambda e: e["configuration"].pop("param_groups"))
    cases.invalid("the extension's configuration has no param_groups", S_GRAD, fx, "schema_violation")
    fails_to_open(cases, fx, "schema_violation", "gradient records have no param_groups")

    fx = "invalid/metadata/gradient_param_group_with_params"
    f = grad_copy(root, fx, ref)
    edit_records(f, 2, lambda e: e["configuration"]["param_groups"][1].__setitem__("params", [2]))
    cases.invalid(
        "a group of the extension's param_groups has a params key", S_GRAD_SEM, fx, "schema_violation"
    )

    fx = "invalid/metadata/gradient_must_understand_false"
    f = grad_copy(root, fx, ref)
    edit_records(f, 2, lambda e: e.__setitem__("must_understand", False))
    cases.invalid("the extension says must_understand false", S_GRAD_SEM, fx, "schema_violation")
    fails_to_open(cases, fx, "schema_violation", "gradient records say must_understand false")

    # stored gradients that do not fit their parameters: the documents agree with the data, the
    # replay chain does not (§8.3: broken_chain)
    fx = "invalid/metadata/gradient_shape_mismatch"
    f = grad_copy(root, fx, ref)

    f.edit_array(2, "grad/model/2.weight", transposed)
    cases.invalid(
        "the gradient of 'model/2.weight' ([2, 4]) is stored with shape [4, 2]",
        S_GRAD_VAL,
        fx,
        "broken_chain",
    )
    cases.valid(
        "its step opens (the documents agree with each other), or fails as its chain is broken",
        S_GRAD_SEM,
        fx,
        "open",
        {"step": 2},
        step=2,
        keys=keys,
        may_fail_with=["broken_chain", *NO_REPLAY],
    )
    cases.error(
        "reading a tensor the replay would define fails: the replay cannot run",
        S_GRAD_VAL,
        fx,
        "read",
        "broken_chain",
        {"tensor": "model/2.weight", "step": 2},
        may_fail_with=["inconsistent_metadata", *NO_REPLAY],
    )

    fx = "invalid/metadata/gradient_dtype_mismatch"
    f = grad_copy(root, fx, ref)
    f.edit_array(2, "grad/model/0.bias", lambda d: d.update(data_type="int32", fill_value=0))
    cases.invalid(
        "the gradient of float32 'model/0.bias' is stored as int32 (same bytes)",
        S_GRAD_VAL,
        fx,
        "broken_chain",
    )
    cases.error(
        "reading a tensor the replay would define fails: the replay cannot run",
        S_GRAD_VAL,
        fx,
        "read",
        "broken_chain",
        {"tensor": "optim/state/1/exp_avg", "step": 2},
        may_fail_with=["inconsistent_metadata", *NO_REPLAY],
    )

    fx = "invalid/integrity/gradient_parent_corrupt"
    f = grad_copy(root, fx, ref, steps=3)
    f.flip("steps/1/optim/state/2/exp_avg_sq/c/0/0", 2)  # damage on disk: commit record untouched
    cases.invalid(
        "one flipped bit in the full step's optimizer state",
        S_INTEGRITY,
        fx,
        "checksum_mismatch",
        {"step": 1},
    )
    for step in (2, 3):
        cases.invalid(
            f"step {step} replays on the damaged state" + (" (through step 2)" if step == 3 else ""),
            S_GRAD_VAL,
            fx,
            "broken_chain",
            {"step": step},
        )
    cases.error(
        "reading a replayed tensor that depends on the damaged one",
        S_GRAD_SEM,
        fx,
        "read",
        "checksum_mismatch",
        {"tensor": "optim/state/2/exp_avg_sq", "step": 2},
        may_fail_with=["broken_chain", *NO_REPLAY],
    )
    cases.add(
        "reading a replayed tensor the damage does not reach: the replay loads the parent's whole state, "
        "so a reader fails, or returns the committed data",
        S_GRAD_SEM,
        fx,
        "read",
        {"tensor": "model/0.weight", "step": 3},
        verdict="valid",
        data_sha256=sha(ref[3]["model/0.weight"]),
        shape=[4, 4],
        may_fail_with=["checksum_mismatch", "broken_chain", *NO_REPLAY],
    )
    cases.reads(
        S_GRAD_SEM,
        fx,
        {"seen": ref[2]["seen"]},
        step=2,
        what=lambda n: ", a state delta the damage does not reach",
        may_fail_with=NO_REPLAY,
    )


def build(root: Path, cases: Cases) -> None:
    ref = replayed_steps(root, cases)
    defects(root, cases, ref)
