"""Generate the conformance fixtures and case files, once. Both are committed; nothing regenerates them.

Usage, from the repository root::

    python -m conformance.generate            # refuses when conformance/fixtures exists
    python -m conformance.generate --force    # deliberate regeneration: review `git diff --stat` after
    python -m conformance.generate --check    # regenerate into a temporary folder and diff (no writes)
    python -m conformance.generate --force --only layouts,deltas   # regenerate some case files only
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import sys
import tempfile
from pathlib import Path

from . import (
    commit,
    composite,
    compression,
    deltas,
    documents,
    dtypes,
    extensions,
    gradient_records,
    hostile,
    integrity,
    layouts,
    metadata,
    names,
    packed,
    repository,
    shapes,
    sharding,
    version2,
)
from .suite import Suite

HERE = Path(__file__).resolve().parent.parent  # conformance/

# Each module is named for its case file and draws its data from its own seeds. The order is the one
# single generator's of old, gradient_records (which also seeds torch's global generator) last.
FEATURES = (
    dtypes,
    shapes,
    names,
    sharding,
    compression,
    repository,
    extensions,
    integrity,
    commit,
    metadata,
    hostile,
    documents,
    gradient_records,
    deltas,
    layouts,
    composite,
    packed,
    version2,
)


def _name(module: object) -> str:
    return module.__name__.rpartition(".")[2]  # type: ignore[attr-defined]


def build(root: Path, only: frozenset[str] | None = None) -> Suite:
    suite = Suite()
    for module in FEATURES:
        if only is None or _name(module) in only:
            module.build(root, suite.cases(_name(module)))
    return suite


def write(out: Path, only: frozenset[str] | None = None) -> Suite:
    fixtures = out / "fixtures"
    fixtures.mkdir(parents=True)
    suite = build(fixtures, only)
    for lock in fixtures.rglob(".ucl-writer.lock"):  # the writers' lock files are not part of a fixture
        lock.unlink()
    # git holds no empty folder, so a fixture holds none either: one left by a deleted chunk
    # (c/3 after c/3/0 is unlinked) would be absent from a clone and make --check differ there
    for folder in sorted((p for p in fixtures.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()
    cases = out / "cases"
    cases.mkdir(parents=True, exist_ok=True)
    for feature, items in suite.by_feature.items():
        (cases / f"{feature}.json").write_text(json.dumps(items, indent=2, ensure_ascii=False) + "\n")
    return suite


def _diff(a: Path, b: Path) -> list[str]:
    out = []
    cmp = filecmp.dircmp(a, b)
    out += [f"only in committed: {a / x}" for x in cmp.left_only]
    out += [f"only in regenerated: {b / x}" for x in cmp.right_only]
    out += [f"differs: {a / x}" for x in cmp.diff_files]
    for sub in cmp.common_dirs:
        out += _diff(a / sub, b / sub)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conformance.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--force", action="store_true", help="delete and regenerate fixtures/ and cases/")
    ap.add_argument(
        "--check", action="store_true", help="regenerate into a temporary folder and list differences"
    )
    ap.add_argument(
        "--only",
        default="",
        help="with --force: regenerate only these case files (comma-separated features) and their fixtures",
    )
    a = ap.parse_args(argv)
    if a.only:
        return _regenerate_only(frozenset(x for x in a.only.split(",") if x), a.force)
    if a.check:
        with tempfile.TemporaryDirectory() as tmp:
            write(Path(tmp))
            diffs = _diff(HERE / "fixtures", Path(tmp) / "fixtures") + _diff(
                HERE / "cases", Path(tmp) / "cases"
            )
        print("\n".join(diffs) or "fixtures and cases are what this script generates")
        return 1 if diffs else 0
    if (HERE / "fixtures").exists() and not a.force:
        print(
            "conformance/fixtures exists; committed fixtures are regenerated only on purpose (--force)",
            file=sys.stderr,
        )
        return 1
    for d in ("fixtures", "cases"):
        shutil.rmtree(HERE / d, ignore_errors=True)
    suite = write(HERE)
    n = sum(len(v) for v in suite.by_feature.values())
    print(
        f"wrote {n} cases in {len(suite.by_feature)} files; review with `git status conformance` and "
        "`git diff --stat conformance`"
    )
    return 0


def _regenerate_only(only: frozenset[str], force: bool) -> int:
    """Regenerate some features: their case files, and the fixture folders their cases use (replaced)."""
    unknown = only - {_name(m) for m in FEATURES}
    if unknown or not force:
        print(f"--only needs --force and known features (unknown: {sorted(unknown)})", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        suite = write(Path(tmp), only)
        for feature, items in suite.by_feature.items():
            for fx in sorted({c["fixture"] for c in items}):
                if not (Path(tmp) / "fixtures" / fx).is_dir():
                    continue  # a fixture another feature builds (its cases may use any fixture)
                shutil.rmtree(HERE / "fixtures" / fx, ignore_errors=True)
                (HERE / "fixtures" / fx).parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(Path(tmp) / "fixtures" / fx, HERE / "fixtures" / fx, symlinks=True)
            (HERE / "cases" / f"{feature}.json").write_text(
                json.dumps(items, indent=2, ensure_ascii=False) + "\n"
            )
    print(f"regenerated {', '.join(sorted(only))}; review with `git status conformance`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
