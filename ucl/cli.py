"""The ``ucl`` command. Exit codes: 0 success / valid, 1 invalid or failed, 2 usage error."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ucl.errors import UCLError


def _print(obj: Any, as_json: bool, text: str) -> None:
    print(json.dumps(obj, indent=1) if as_json else text)


def cmd_validate(a: argparse.Namespace) -> int:
    from ucl.validator import validate_repo

    report = validate_repo(a.path, a.step, checksums=not a.no_checksums)
    if a.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for p in report.problems:
            where = " ".join(x for x in [f"step {p.step}" if p.step is not None else "",
                                         f"tensor {p.tensor!r}" if p.tensor else "", f"file {p.file}" if p.file else ""] if x)
            print(f"INVALID [{p.code}] {p.message}" + (f"  ({where})" if where else ""))
        verdict = "valid" if report.ok else f"invalid: {len(report.problems)} problem(s)"
        print(f"{report.path}: {len(report.steps)} step(s), {report.files_checked} shard(s), "
              f"{report.bytes_checked / 1e6:.1f} MB checked: {verdict}")
    return 0 if report.ok else 1


def cmd_ls(a: argparse.Namespace) -> int:
    from ucl.repo import Repository

    repo = Repository.open(a.path)
    rows = []
    for s in repo.steps():
        try:
            r = repo.commit_record(s)
            rows.append({"step": s, "kind": r.kind, "parent": r.parent, "bytes": r.nbytes, "time": r.time})
        except UCLError as e:
            rows.append({"step": s, "error": e.code})
    text = "\n".join(f"{r['step']:>10}  {r.get('kind', '?'):5}  {r.get('bytes', 0) / 1e6:10.1f} MB  {r.get('time', r.get('error'))}"
                     for r in rows) or "(no committed steps)"
    _print(rows, a.json, f"{'step':>10}  kind   {'size':>13}  time\n{text}")
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    import ucl

    with ucl.open(a.path, a.step) as ckpt:
        tensors = [{"name": n, "dtype": m.dtype, "shape": list(m.shape), "chunk_shape": list(m.chunk_shape),
                    "bytes": m.nbytes} for n, m in ckpt.meta.arrays.items()]
        info = {"step": ckpt.step, "kind": ckpt.kind, "parent": ckpt.meta.parent, "layout": ckpt.meta.layout,
                "mesh": ckpt.meta.mesh, "bytes": ckpt.record.nbytes, "tensors": tensors}
        lines = [f"step {ckpt.step} ({ckpt.kind}), {len(tensors)} tensors, {ckpt.record.nbytes / 1e6:.1f} MB"]
        lines += [f"  {t['name']:60} {t['dtype']:14} {t['shape']}" for t in tensors]
        _print(info, a.json, "\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucl", description="Universal Checkpoint Language: inspect, validate and "
                                "convert checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("validate", help="check a repository against the spec (exit 0 valid, 1 invalid)")
    v.add_argument("path", help="repository directory or URL")
    v.add_argument("--step", type=int, help="only this step")
    v.add_argument("--no-checksums", action="store_true", help="skip reading data (structure and sizes only)")
    v.add_argument("--json", action="store_true", help="machine-readable report")
    v.set_defaults(func=cmd_validate)

    ls = sub.add_parser("ls", help="list committed steps with kind, size and time")
    ls.add_argument("path")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    info = sub.add_parser("info", help="tensors, dtypes, shapes and layout of a step")
    info.add_argument("path")
    info.add_argument("--step", type=int, help="default: the latest committed step")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) and 2
    try:
        return int(a.func(a))
    except UCLError as e:
        if getattr(a, "json", False):
            print(json.dumps({"error": e.to_dict()}))
        else:
            print(f"ucl: error [{e.code}]: {e.message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
