"""Blocked: how long each CheckpointManager.save blocks training, the first one of a process included.

    ./dev bench blocked [--size small|gpt2|medium] [--reps 3] [--baseline DIR] [--dir DIR]

The state is bench/save.py's: a GPT-2-like fp32 model plus its AdamW state (exp_avg, exp_avg_sq);
``--size gpt2`` is GPT-2 small's shapes (124 M parameters: 1.49 GB with AdamW, issue 14's state). Every
case runs in a fresh process, the cases interleaved, ``--reps`` rounds; the table gives medians.

Rows:
- memcpy, warm destination: one copy of the state into memory already touched (the floor);
- memcpy, fresh destination: the same into new memory (what touching pages costs on this machine);
- ucl, one row per way of getting the staging memory (``CheckpointManager(prepare=...)``): ``False``
  (each slot allocated by the save that first needs it), the default (the first save allocates its slot,
  the others are prepared after it), ``prepare=state`` with the first save after ``--train-s`` seconds of
  training (a matmul loop on both cores) or at once (racing the background touching),
  ``prepare(state, wait=True)``, and a loop of ``save_if_due`` (no ``prepare=``; one call per training
  step of ``--train-s`` / 5 seconds, ``AdaptiveInterval(mtbf=3600, max_interval=<a step>)``: its first
  call saves nothing and prepares the staging memory, the next four save, each after a step of training),
  and a staging budget of half the state (``staging_bytes``: two slots of a quarter, so every save is
  staged in pieces, each piece waiting for the persister to free a slot: a save blocks for most of a
  persist, and the persister is not held while it copies);
  ``--baseline DIR`` adds the ucl found in DIR (e.g. ``git archive HEAD ucl | tar -x -C DIR`` plus the
  built ``ucl/*.so``): the behaviour before preparing existed.

Columns: the blocked time of saves 1-4 (saves 2 and 3 after the previous step committed; save 4 at once
after save 3, while step 3 persists: it takes the other slot, and the persister starts nothing new while
it copies; in the ``save_if_due`` row each save comes one training step after the previous one),
saves against the warm memcpy (target <= 1.5x), save 1 against a copy of the state into a staging slot
timed in the same process right after its saves (on a shared machine, the ratio that other work
disturbs least), the staging bytes the background threads had not touched
yet when save 1 began, and the peak RSS above the state against the staging budget (two slots; target: at
most 10% more).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as c  # noqa: E402
from save import training_state  # noqa: E402

c.SIZES.setdefault("gpt2", (50257, 1024, 768, 12))  # GPT-2 small: 124 M parameters

CASES = ["memcpy warm", "memcpy fresh", "ucl prepare=False", "ucl default", "ucl prepare=state + training",
         "ucl prepare=state + save at once", "ucl prepare(wait=True)", "ucl save_if_due + training",
         "ucl staging_bytes=state/2"]
BASELINE = "ucl baseline (--baseline)"


def _train(seconds: float) -> None:
    """Stand-in for training between setup and the first save: matmuls on the default threads."""
    import torch

    a = torch.randn(512, 512)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)


def _left(mgr: object) -> int:
    """Bytes of staging the preparers had not reached yet."""
    from ucl.write.staging import aligned

    return sum(s.nbytes if not s.allocated else max(0, s.low - aligned(s.claim)) for s in mgr._staging.slots)


def _copy_into_slot(mgr: object, state: dict) -> float:
    """A plain copy of the state into a staging slot (warm memory now), timed."""
    from ucl.write.staging import aligned

    slot = mgr._staging.slots[0]
    views, offset = [], 0
    for t in state.values():
        views.append(slot.view(offset, t))
        offset += aligned(t.nbytes)
    t0 = time.perf_counter()
    for dst, src in zip(views, state.values(), strict=True):
        dst.copy_(src)
    return time.perf_counter() - t0


def _save_if_due(mgr: object, state: dict, step_s: float) -> tuple[list[float], float]:
    """A training loop calling save_if_due once per step until it saved four times: each saving
    call's time, and the staging the preparers had not reached when the first save began."""
    blocked: list[float] = []
    left = float("nan")
    step = 0
    while len(blocked) < 4:
        _train(step_s)
        before = _left(mgr)
        t0 = time.perf_counter()
        handle = mgr.save_if_due(step, state)
        dt = time.perf_counter() - t0
        if handle is not None:
            left = before if not blocked else left
            blocked.append(dt)
        step += 1
    return blocked, left


def child(case: str, size: str, root: str, train_s: float) -> dict:
    import torch

    state = training_state(size)
    nbytes = c.state_nbytes(state)
    load = os.getloadavg()[0]  # the machine's other work (shared machines: say how noisy the run was)
    c.reset_peak_rss()
    base = c.rss()
    out = os.path.join(root, "repo")
    shutil.rmtree(out, ignore_errors=True)
    blocked: list[float] = []
    left = float("nan")
    kw: dict = {}
    if case.startswith("memcpy"):
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        if case == "memcpy warm":
            for k, v in state.items():  # touch the destination pages
                dst[k].copy_(v)
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        blocked = [time.perf_counter() - t0]
    else:
        from ucl.write.manager import CheckpointManager

        if case == "ucl prepare=False":
            kw["prepare"] = False
        elif case.startswith("ucl prepare=state"):
            kw["prepare"] = state
        elif case == "ucl staging_bytes=state/2":
            kw["staging_bytes"] = nbytes // 2
        if case == "ucl save_if_due + training":
            from ucl.write.policy import AdaptiveInterval

            kw["interval"] = AdaptiveInterval(mtbf=3600, max_interval=train_s / 5)
        with CheckpointManager(out, **kw) as mgr:
            if case == "ucl save_if_due + training":
                blocked, left = _save_if_due(mgr, state, train_s / 5)
            else:
                if case == "ucl prepare(wait=True)":
                    mgr.prepare(state, wait=True)
                elif case.endswith("training"):
                    _train(train_s)
                handles = []
                for step in range(4):
                    if step in (1, 2):
                        handles[-1].result()  # saves 2 and 3: after the previous step committed
                    if step == 0:
                        left = _left(mgr)
                    t0 = time.perf_counter()
                    handles.append(mgr.save(step, state))  # save 4: at once, while step 3 persists
                    blocked.append(time.perf_counter() - t0)
            mgr.wait()
            peak = c.peak_rss() - base
            # the same process's floor, just after (the same noise); a slot smaller than the state: none
            memcpy = _copy_into_slot(mgr, state) if "staging_bytes" not in kw else float("nan")
    if case.startswith("memcpy"):
        peak = c.peak_rss() - base
        memcpy = blocked[0]
    shutil.rmtree(out, ignore_errors=True)
    return {"case": case, "bytes": nbytes, "blocked": blocked, "peak": peak, "left": left, "load": load,
            "memcpy": memcpy,
            "budget": kw.get("staging_bytes") or 2 * sum(-(-t.nbytes // 4096) * 4096 for t in state.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(c.SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-s", type=float, default=5.0,
                    help="seconds of training before the first save (prepare=state)")
    ap.add_argument("--baseline", default=None, help="a directory holding an earlier ucl package")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under ./bench-out)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", nargs=2, metavar=("CASE", "ROOT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.child[0] == BASELINE:
            sys.path.insert(0, os.path.abspath(a.baseline))
        print(json.dumps(child(a.child[0], a.size, a.child[1], a.train_s)))
        return
    cases = a.cases.split(",") + ([BASELINE] if a.baseline else [])
    os.makedirs(a.dir or "bench-out", exist_ok=True)
    root = tempfile.mkdtemp(prefix="blocked-", dir=a.dir or "bench-out")
    runs: dict[str, list[dict]] = {k: [] for k in cases}
    try:
        for rep in range(a.reps):
            for case in cases[rep % len(cases):] + cases[: rep % len(cases)]:  # interleaved, rotated
                os.sync()
                argv = [__file__, "--size", a.size, "--train-s", str(a.train_s), "--child", case, root]
                if a.baseline:
                    argv += ["--baseline", a.baseline]
                r = c.run_child(argv)
                runs[case].append(r)
                print(f"  {rep} {case}: {json.dumps(r)}", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = runs[cases[0]][0]["bytes"]
    floor = c.median([r["blocked"][0] for r in runs.get("memcpy warm", [])])
    table = []
    for case in cases:
        rs = runs[case]
        saves = [c.median([r["blocked"][i] for r in rs]) for i in range(len(rs[0]["blocked"]))]
        cells = [f"{s:.3f} s" for s in saves] + ["-"] * (4 - len(saves))
        peak = c.median([r["peak"] for r in rs])
        budget = rs[0]["budget"]
        ucl = case.startswith("ucl")
        left = c.median([r["left"] for r in rs])
        best = min(r["blocked"][0] for r in rs)
        same = c.median([r["blocked"][0] / r["memcpy"] for r in rs])
        table.append([case, *cells, f"{best:.3f} s", f"{saves[0] / floor:.2f}x", f"{same:.2f}x",
                      f"{max(saves[:3]) / floor:.2f}x", c.fmt_bytes(left) if ucl else "-", c.fmt_bytes(peak),
                      f"{peak / budget:.2f}x" if ucl else "-"])
    load = c.median([r["load"] for v in runs.values() for r in v])
    print(f"\nblocked time of saves of a GPT-2-like model + AdamW state, size={a.size}: "
          f"{c.fmt_bytes(nbytes)} fp32; median of {a.reps}, fresh process per case; {c.machine_line()}; "
          f"load average at the cases' start: median {load:.1f}")
    print(f"command: ./dev bench blocked --size {a.size} --reps {a.reps} --train-s {a.train_s:g}\n")
    print(c.markdown_table(["case", "save 1", "save 2", "save 3", "save 4 (during 3's persist)",
                            "save 1, best", "save 1 / memcpy", "save 1 / same process's memcpy",
                            "worst of 1-3 / memcpy",
                            "staging untouched at save 1", "peak RSS above state", "/ staging budget"],
                           table))


if __name__ == "__main__":
    main()
