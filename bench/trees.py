"""Before/after: one benchmark run in two source trees, interleaved, in one run of this script.

    python bench/trees.py --before REV [--rounds 2] BENCH [ARGS...]
    e.g. python bench/trees.py --before d790329 --rounds 2 read --size small

The *before* tree is a git worktree of REV (under bench-out/trees/, with this checkout's built C
extensions copied in: a change to engine/ is not what this compares); the *after* tree is this checkout.
Rounds alternate before, after, before, after, ...; each runs ``bench/BENCH.py ARGS`` of its own tree
with that tree first on ``PYTHONPATH`` (its children inherit it), so the machine's noise falls on both
alike. Printed: every markdown table row that names ucl (or matches ``--rows``), from every run,
grouped by row, before beside after, then the full output of the last round of each tree.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def worktree(rev: str) -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = os.path.join(REPO, "bench-out", "trees", sha)
    if not os.path.isdir(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", path, sha], cwd=REPO, check=True)
    for so in glob.glob(os.path.join(REPO, "ucl", "*.so")):
        shutil.copy2(so, os.path.join(path, "ucl"))
    return path


def run(tree: str, bench: str, args: list[str]) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    script = os.path.join(tree, "bench", f"{bench}.py")
    proc = subprocess.run([sys.executable, script, *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{bench} failed in {tree}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout, time.perf_counter() - t0


def rows_of(out: str, pattern: str) -> list[str]:
    """The markdown table rows of ``out`` whose text matches ``pattern`` (separator rows left out)."""
    rx = re.compile(pattern, re.I)
    return [line.strip() for line in out.splitlines()
            if line.startswith("|") and rx.search(line) and not set(line.strip()) <= set("|-: ")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="git revision of the before tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default="ucl", help="regex: the table rows to compare (default: rows naming ucl)")
    ap.add_argument("bench")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    trees = {"before": worktree(a.before), "after": REPO}
    outs: dict[str, list[str]] = {"before": [], "after": []}
    for r in range(a.rounds):
        for side in ("before", "after"):
            out, secs = run(trees[side], a.bench, a.args)
            outs[side].append(out)
            print(f"round {r + 1} {side}: {secs:.0f} s", flush=True)
    print(f"\n## {a.bench} {' '.join(a.args)}: rows matching {a.rows!r}, before ({a.before}) and after, "
          f"{a.rounds} rounds each\n")
    rows: dict[str, dict[str, list[str]]] = {}
    for side, runs in outs.items():
        for out in runs:
            for line in rows_of(out, a.rows):
                key = line.split("|")[1].strip()
                rows.setdefault(key, {"before": [], "after": []})[side].append(line)
    for key, sides in rows.items():
        print(f"### {key}")
        for side in ("before", "after"):
            for line in sides[side]:
                print(f"{side:6} {line}")
        print()
    for side in ("before", "after"):
        print(f"\n## last round, {side}\n")
        print(outs[side][-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
