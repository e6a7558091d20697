"""Goodput under failures: useful training per wall second (ETTR) for each way of checkpointing.

    python bench/goodput.py [--preset small] [--steps 300] [--mtbf 20] [--seeds 2] [--dcp-every 10 25]

A real training loop (the demo's GPT, ``ucl.testing.gpt``, AdamW) runs as a child process; the parent
kills it with SIGKILL at random times (exponential gaps, mean ``--mtbf`` seconds of wall time, the
same gaps for every case of a seed) and starts it again, until ``--steps`` steps are done. Each
restart pays what a real one pays: a fresh interpreter, imports, the restore, and the work since the
last checkpoint done again. Cases:

- ``no checkpoint, no failure``: the ideal run (one process start, no saves) that ETTR is measured
  against: ETTR = its wall time / the case's wall time.
- ``ucl tiered``: ``CheckpointManager(disk, memory=MemoryTier(/dev/shm/..., interval=Young/Daly))``,
  a save every step committed to the memory tier, drained to disk by the Young/Daly interval; restore
  from the newest committed step of either (a process kill: the memory tier survives).
- ``ucl tiered, Young/Daly``: the same tiers, the saves to memory by ``save_if_due`` (the Young/Daly
  interval of the blocked time) instead of every step.
- ``ucl disk``: ``CheckpointManager(disk, interval=AdaptiveInterval(mtbf))`` (``save_if_due``).
- ``DCP async every k``: ``dcp.async_save`` every k steps (the previous one waited for first); restore
  from the newest directory with its ``.metadata``.

Printed per case (means over seeds): wall seconds, ETTR, failures, work lost (steps done again),
restore seconds (process start to the first step: interpreter, imports, restore), and the time the
saves blocked training.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


# -- the training child ------------------------------------------------------------------------------
def child(case: str, root: str, steps: int, preset: str, mtbf: float, every: int, progress: str) -> None:
    t_spawn = float(os.environ["GOODPUT_SPAWNED"])
    import torch

    from ucl.testing.gpt import SyntheticData, full_state, load_full_state, make_model_and_optimizer, train_step

    torch.manual_seed(0)
    model, opt = make_model_and_optimizer(preset, seed=0)
    data = SyntheticData(model.config, seed=0)
    out = open(progress, "a", buffering=1)  # noqa: SIM115 - one line per event, flushed
    start, mgr, dcp, pending = 1, None, None, None
    if case.startswith("ucl"):
        from ucl import CheckpointManager
        from ucl.write.policy import AdaptiveInterval
        from ucl.write.tiers import MemoryTier

        interval = AdaptiveInterval(mtbf)
        if case == "ucl tiered":
            mgr = CheckpointManager(os.path.join(root, "disk"), keep_last=2,
                                    memory=MemoryTier(os.environ["GOODPUT_SHM"], keep_last=2, interval=interval))
        elif case == "ucl tiered, Young/Daly":
            mgr = CheckpointManager(os.path.join(root, "disk"), keep_last=2, interval=AdaptiveInterval(mtbf),
                                    memory=MemoryTier(os.environ["GOODPUT_SHM"], keep_last=2, interval=interval))
        else:
            mgr = CheckpointManager(os.path.join(root, "disk"), keep_last=2, interval=interval)
        if mgr.latest_step() is not None:
            state = mgr.restore()
            load_full_state(model, opt, state["train"])
            start = state["step"] + 1
    elif case.startswith("DCP"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = sorted((int(d), d) for d in os.listdir(root) if d.isdigit()
                      and os.path.exists(os.path.join(root, d, ".metadata")))
        if done:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd, "step": torch.tensor(0)}
            dcp.load(sd, checkpoint_id=os.path.join(root, done[-1][1]), no_dist=True)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            start = int(sd["step"]) + 1
    out.write(json.dumps({"event": "start", "step": start, "restore_s": time.time() - t_spawn}) + "\n")
    for step in range(start, steps + 1):
        train_step(model, opt, data.batch(step))
        t0 = time.perf_counter()
        if mgr is not None:
            state = {"train": full_state(model, opt), "step": step}
            if case == "ucl tiered":
                mgr.save(step, state)
            else:
                mgr.save_if_due(step, state)
        elif dcp is not None and step % every == 0:
            if pending is not None:
                pending.result()
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save({"model": msd, "optim": osd, "step": torch.tensor(step)},
                                     checkpoint_id=os.path.join(root, str(step)), no_dist=True)
        out.write(json.dumps({"event": "step", "step": step, "save_s": time.perf_counter() - t0}) + "\n")
    if mgr is not None:
        mgr.close()
    if pending is not None:
        pending.result()
    out.write(json.dumps({"event": "done"}) + "\n")


# -- the parent ---------------------------------------------------------------------------------------
def run_case(case: str, args: argparse.Namespace, seed: int, base: str, every: int = 0) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="goodput-", dir=base)
    shm_root = tempfile.mkdtemp(prefix="ucl-goodput-", dir="/dev/shm" if os.path.isdir("/dev/shm") else root)
    progress = os.path.join(root, "progress.jsonl")
    rng = random.Random(seed)
    failures = 0
    t_begin = time.monotonic()
    allow_failures = case != "no checkpoint, no failure"
    while True:
        gap = rng.expovariate(1.0 / args.mtbf) if allow_failures else float("inf")
        env = dict(os.environ, GOODPUT_SPAWNED=repr(time.time()), GOODPUT_SHM=shm_root, PYTHONWARNINGS="ignore")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--root", root, "--steps",
               str(args.steps), "--preset", args.preset, "--mtbf", str(args.mtbf), "--every", str(every),
               "--progress", progress]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            p.wait(timeout=gap if gap != float("inf") else None)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            failures += 1
            continue
        err = p.stderr.read().decode() if p.stderr else ""
        if p.returncode != 0:
            raise RuntimeError(f"{case}: the training child failed ({p.returncode}):\n{err[-3000:]}")
        break
    wall = time.monotonic() - t_begin
    with open(progress) as f:
        events = [json.loads(line) for line in f if line.strip()]
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(shm_root, ignore_errors=True)
    # work lost: the steps each restart does again (its start step vs the last step done before the kill)
    lost, last, restores = 0, 0, []
    for e in events:
        if e["event"] == "start":
            lost += max(0, last - e["step"] + 1)
            restores.append(e["restore_s"])
        elif e["event"] == "step":
            last = e["step"]
    saves = sum(e["save_s"] for e in events if e["event"] == "step")
    return {"wall": wall, "failures": failures, "lost": lost, "restore": sum(restores) / len(restores),
            "saves": saves}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--mtbf", type=float, default=20.0, help="mean seconds between failures")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--dcp-every", type=int, nargs="+", default=[10, 25])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--every", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.root, args.steps, args.preset, args.mtbf, args.every, args.progress)
        return 0
    base = args.dir or tempfile.mkdtemp(prefix="ucl-goodput-")
    os.makedirs(base, exist_ok=True)
    cases: list[tuple[str, int]] = [("no checkpoint, no failure", 0), ("ucl tiered", 0),
                                    ("ucl tiered, Young/Daly", 0), ("ucl disk", 0)]
    cases += [(f"DCP async every {k}", k) for k in args.dcp_every]
    print(f"`python bench/goodput.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    results: dict[str, list[dict[str, Any]]] = {c: [] for c, _ in cases}
    for seed in range(args.seeds):
        for case, k in (cases if seed % 2 == 0 else [cases[0], *reversed(cases[1:])]):
            results[case].append(run_case(case, args, seed, base, k))
    ideal = sum(r["wall"] for r in results[cases[0][0]]) / args.seeds

    def mean(case: str, key: str) -> float:
        return sum(r[key] for r in results[case]) / len(results[case])

    print(f"**Goodput** ({args.preset} GPT, {args.steps} steps, failures every {args.mtbf:g} s on average "
          f"(SIGKILL, exponential), {args.seeds} seed(s), means; ETTR = ideal wall / wall):\n")
    print("| case | wall s | ETTR | 1 - ETTR | failures | steps lost | restore s (start to first step) | "
          "saves blocked s |")
    print("|---|---|---|---|---|---|---|---|")
    for case, _ in cases:
        w = mean(case, "wall")
        print(f"| {case} | {w:.1f} | {ideal / w:.3f} | {1 - ideal / w:.3f} | {mean(case, 'failures'):.1f} | "
              f"{mean(case, 'lost'):.1f} | {mean(case, 'restore'):.2f} | {mean(case, 'saves'):.1f} |")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
