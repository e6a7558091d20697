"""Composite steps (spec/delta.md §9) on a real CPU training run: what they save, and what they cost.

    python bench/composite.py [--preset small] [--warmup 10] [--saves 12] [--resume 12] [--seeds 3]
                              [--thresholds 0.01 0.03 0.1] [--max-age 8] [--dir DIR]

Trains the demo's GPT (``ucl.testing.gpt``, preset ``small``: 11M parameters, AdamW; about 136 MB of
state) for ``--warmup`` steps, then saves every step for ``--saves`` steps through one
``CheckpointManager`` per policy (each save waited for before the next, so the timings do not
overlap). Each policy has a pass of its own over the same deterministic run (one manager in memory at a
time; the state at the last save is checked bit-identical across the passes):

- ``full``: every step full (``delta=None``);
- ``lossless delta``: ``DeltaPolicy(base="previous")`` (exact);
- ``composite t=<t>``: ``DeltaPolicy(base="previous", prune=Prune(threshold=t, max_age=...))``
  (approximate: groups whose relative update norm since their last stored version is at most t are
  references to older steps).

Table 1 (seed 0): bytes per step (the mean over the saves after the first, which is full for every
policy), stale groups per step, the time ``save`` blocked training (staging) and the time to durable
commit (the persister: selection statistic, encoding, writes, commit), medians.

Table 2 (every seed): resume from the last composite step (``restore(approximate=True)``) and from
the exact state at the same step, train ``--resume`` more steps on the same batches, and compare the
losses: the mean over the resumed steps of (loss after a composite resume - loss after an exact
resume), and its spread over seeds. Beside it, a fixed-interval full checkpoint with the same storage
budget as the composite run: exact (bit-exact resume, so no loss difference), but a failure loses on
average (k - 1) / 2 steps of work for an interval of k steps.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from ucl.errors import ApproximateWarning
from ucl.testing.gpt import SyntheticData, full_state, load_full_state, make_model_and_optimizer, train_step
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy
from ucl.write.prune import Prune


def policies(args: argparse.Namespace, exact_too: bool) -> list[tuple[str, DeltaPolicy | None]]:
    out: list[tuple[str, DeltaPolicy | None]] = []
    if exact_too:
        out += [("full", None), ("lossless delta", DeltaPolicy(base="previous", full_every=args.saves + 1))]
    out += [(f"composite t={t:g}", DeltaPolicy(base="previous", full_every=args.saves + 1,
                                                prune=Prune(threshold=t, max_age=args.max_age)))
            for t in args.thresholds]
    return out


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_seed(args: argparse.Namespace, seed: int, root: str, exact_too: bool) -> dict[str, Any]:
    """Per policy, one pass: train, save every step through that policy's manager, resume from its
    latest step. The passes train the same deterministic run (checked: the live state at the last save
    is bit-identical in every pass), one manager alive at a time: a medium state's staging, and a
    composite manager's host copy, would not fit beside four others."""
    pols = policies(args, exact_too)
    data = None
    out: dict[str, Any] = {"timing": {}, "bytes": {}, "stale": {}, "resume": {}, "at_last": {}, "groups": 0}
    last = args.warmup + args.saves
    digests = set()
    for i, (name, pol) in enumerate(pols):
        model, opt = make_model_and_optimizer(args.preset, seed=seed)
        data = SyntheticData(model.config, seed=seed)
        for step in range(1, args.warmup + 1):
            train_step(model, opt, data.batch(step))
        path = os.path.join(root, f"s{seed}-{i}")
        mgr = CheckpointManager(path, delta=pol)
        composite = pol is not None and pol.prune is not None  # optimizer=: its state joins its parameter
        timing = []
        for step in range(args.warmup + 1, last + 1):
            train_step(model, opt, data.batch(step))
            state = full_state(model, opt)
            t0 = time.perf_counter()
            h = mgr.save(step, state, optimizer=opt if composite else None)
            h.result()
            timing.append((h.staged_s, time.perf_counter() - t0))
        out["timing"][name] = timing
        digests.add(_digest(model))
        repo = mgr.repo
        out["bytes"][name] = [repo.commit_record(s).nbytes for s in repo.steps()]
        comps = [repo.step_meta(s).composite for s in repo.steps()]
        out["stale"][name] = [0 if c is None else len(c.stale) for c in comps]
        out["groups"] = max([c.groups for c in comps if c is not None], default=0) or out["groups"]
        starts: dict[str, Any] = {}
        if i == 0:
            starts["exact"] = copy.deepcopy(full_state(model, opt))
        if composite:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ApproximateWarning)
                starts[name] = mgr.restore(approximate=True)
            c = repo.step_meta(last).composite
            out["at_last"][name] = (0, 0) if c is None else (len(c.stale), max(g.age for g in c.stale))
        mgr.close()
        del model, opt, state
        for key, start in starts.items():
            model2, opt2 = make_model_and_optimizer(args.preset, seed=seed)
            load_full_state(model2, opt2, start)
            out["resume"][key] = [train_step(model2, opt2, data.batch(s))
                                  for s in range(last + 1, last + 1 + args.resume)]
            del model2, opt2
        del starts
        if not args.dir:  # a medium run would otherwise hold tens of GB per seed
            shutil.rmtree(path, ignore_errors=True)
    if len(digests) != 1:
        raise RuntimeError(f"seed {seed}: the passes trained different states ({len(digests)} digests): "
                           "training is not deterministic here, so the policies did not see one run")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--resume", type=int, default=12)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    p.add_argument("--max-age", type=int, default=8)
    p.add_argument("--dir", default=None, help="where the repositories go (default: a temporary directory)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="ucl-composite-")
    os.makedirs(root, exist_ok=True)
    print(f"`python bench/composite.py {' '.join(sys.argv[1:] if argv is None else argv)}`  "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    t_all = time.perf_counter()
    runs = [run_seed(args, seed, root, exact_too=seed == 0) for seed in range(args.seeds)]
    r0 = runs[0]
    full_bytes = r0["bytes"]["full"][0]
    print(f"**Saves** ({args.preset}, seed 0, steps {args.warmup + 1}-{args.warmup + args.saves}, a save "
          f"every step, the first full; {r0['groups']} groups; max_age {args.max_age}):\n")
    lossless = statistics.mean(r0["bytes"]["lossless delta"][1:] or r0["bytes"]["lossless delta"])
    print("| policy | bytes/step (MB) | vs full | vs lossless delta | stale groups/step | save blocks (ms) | "
          "to durable (ms) |")
    print("|---|---|---|---|---|---|---|")
    for name, sizes in r0["bytes"].items():
        later = sizes[1:] if len(sizes) > 1 else sizes
        per = statistics.mean(later)
        stale = statistics.mean(r0["stale"][name][1:]) if len(sizes) > 1 else 0
        block = statistics.median(t[0] for t in r0["timing"][name][1:]) * 1e3
        durable = statistics.median(t[1] for t in r0["timing"][name][1:]) * 1e3
        print(f"| {name} | {per / 1e6:.1f} | {full_bytes / per:.2f}x | {lossless / per:.2f}x | {stale:.1f} | "
              f"{block:.0f} | {durable:.0f} |")
    print(f"\nfull step: {full_bytes / 1e6:.1f} MB\n")
    print(f"**Resume** from step {args.warmup + args.saves}, {args.resume} more steps, {args.seeds} seed(s): "
          "loss after a composite resume minus after an exact one (mean over the resumed steps; over seeds: "
          "mean, min, max); the same storage budget as a fixed-interval full checkpoint:\n")
    print("| policy | stale groups at resume (oldest, steps) | loss diff mean | min | max | "
          "final-step diff (mean) | full every k steps, same bytes | expected lost steps |")
    print("|---|---|---|---|---|---|---|---|")
    for name in [n for n in r0["resume"] if n != "exact"]:
        diffs = [statistics.mean(a - b for a, b in zip(r["resume"][name], r["resume"]["exact"], strict=True))
                 for r in runs]
        finals = [r["resume"][name][-1] - r["resume"]["exact"][-1] for r in runs]
        total = sum(r0["bytes"][name])
        k = args.saves * full_bytes / total
        stale, age = r0["at_last"][name]
        print(f"| {name} | {stale} ({age}) | {statistics.mean(diffs):+.5f} | {min(diffs):+.5f} | "
              f"{max(diffs):+.5f} | {statistics.mean(finals):+.5f} | {k:.2f} | "
              f"{max(0.0, (math.ceil(k) - 1) / 2):.1f} |")
    exact_loss = statistics.mean(statistics.mean(r["resume"]["exact"]) for r in runs)
    drop = statistics.mean((r["resume"]["exact"][0] - r["resume"]["exact"][-1]) / max(1, args.resume - 1)
                           for r in runs)
    print(f"\nexact resume: mean loss {exact_loss:.4f} over the resumed steps, falling {drop:.4f} per step "
          "there (a loss difference of d is worth about d / that many steps of training); a lossless or full "
          "checkpoint resumes bit-exactly (examples/demo.py checks it), so its loss difference is 0 by "
          "construction")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
